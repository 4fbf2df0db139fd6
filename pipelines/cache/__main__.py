"""`python -m pipelines.cache keygen NAME FILE`: a named signing key pair (the remote cache's,
or the image attestations': one form for both)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipelines.errors import run_main
from pipelines.namedkeys import keygen


def main(argv: list[str] | None = None) -> int:
    """Write the secret key to FILE (`name:base64`, mode 600) and print the public key."""
    parser = argparse.ArgumentParser(prog="python -m pipelines.cache")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("keygen", help="make a named ed25519 key pair (name:base64)")
    gen.add_argument("name", help="the key's name, e.g. lab-ci-2026 (signatures carry it)")
    gen.add_argument("file", type=Path, help="where the private key goes (must not exist)")
    args = parser.parse_args(argv)
    public = keygen(args.name, args.file)
    print(public)
    print(
        f"secret key: {args.file} (mode 600): its contents are a signing key"
        " (SPARKFORGE_CACHE_SIGNING_KEY, SPARKFORGE_SIGNING_KEY or SPARKFORGE_SIGNING_KEY_FILE);"
        " the line above goes into a trusted list (SPARKFORGE_CACHE_TRUSTED_KEYS,"
        " SPARKFORGE_TRUSTED_KEYS)",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    run_main(main)
