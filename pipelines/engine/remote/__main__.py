"""`python -m pipelines.engine.remote keygen NAME FILE`: a named signing key pair (the remote
cache's, or the image attestations': one form for both); `python -m pipelines.engine.remote gc`:
what the remote cache holds that no root reaches."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from pipelines.core.errors import BadInput, run_main
from pipelines.core.progress import say, show
from pipelines.core.settings import read_settings
from pipelines.core.signing.namedkeys import keygen


def main(argv: list[str] | None = None) -> int:
    """keygen: write the secret key to FILE (`name:base64`, mode 600) and print the public key;
    gc: say (or, with --delete, delete) what the remote cache holds that no root reaches."""
    parser = argparse.ArgumentParser(prog="python -m pipelines.engine.remote")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("keygen", help="make a named ed25519 key pair (name:base64)")
    gen.add_argument("name", help="the key's name, e.g. lab-ci-2026 (signatures carry it)")
    gen.add_argument("file", type=Path, help="where the private key goes (must not exist)")
    gc = commands.add_parser("gc", help="entries unused for D days no root reaches; orphan objects")
    gc.add_argument("--days", type=float, default=30.0, help="entries written since stay (30)")
    gc.add_argument(
        "--roots",
        type=Path,
        action="append",
        default=[],
        help="a roots file `doit gc` wrote (<store>/gc/roots.json); its step keys stay",
    )
    gc.add_argument("--delete", action="store_true", help="delete (default: a dry run)")
    args = parser.parse_args(argv)
    if args.command == "gc":
        return collect(args.days, args.roots, args.delete)
    public = keygen(args.name, args.file)
    show(public)
    show(
        f"secret key: {args.file} (mode 600): its contents are a signing key"
        " (SPARKFORGE_CACHE_SIGNING_KEY, SPARKFORGE_SIGNING_KEY or SPARKFORGE_SIGNING_KEY_FILE);"
        " the line above goes into a trusted list (SPARKFORGE_CACHE_TRUSTED_KEYS,"
        " SPARKFORGE_TRUSTED_KEYS)",
        stream=sys.stderr,
    )
    return 0


def collect(days: float, roots: list[Path], really: bool) -> int:
    """gc of the cache SPARKFORGE_REMOTE_CACHE names (S3 from the standard AWS chain)."""
    from pipelines.engine.remote.gc import collect_cache

    url = read_settings(os.environ).remote_cache
    if not url:
        raise BadInput("environment SPARKFORGE_REMOTE_CACHE: not set; expected s3://BUCKET/PREFIX")
    for line in collect_cache(url, days, roots, really, time.time()):
        say("cache gc", line)
    if not really:
        say("cache gc", "dry run, nothing deleted; --delete deletes what it would free")
    return 0


if __name__ == "__main__":
    run_main(main)
