"""`python -m pipelines.cache keygen FILE`: a signing key pair for the remote cache."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipelines.cache.signing import keygen
from pipelines.errors import run_main


def main(argv: list[str] | None = None) -> int:
    """Write the private key to FILE (PEM, mode 600) and print the public key (base64)."""
    parser = argparse.ArgumentParser(prog="python -m pipelines.cache")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("keygen", help="make an ed25519 key pair for signing cache entries")
    gen.add_argument("file", type=Path, help="where the private key goes (must not exist)")
    args = parser.parse_args(argv)
    public = keygen(args.file)
    print(public)
    print(
        f"private key: {args.file} (mode 600): its contents are SPARKFORGE_CACHE_SIGNING_KEY;"
        " the line above goes into SPARKFORGE_CACHE_TRUSTED_KEYS",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    run_main(main)
