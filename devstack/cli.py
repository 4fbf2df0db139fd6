"""`scripts/stack up|down|status`: the stack's command line."""

from __future__ import annotations

import argparse
import sys

from devstack.commands import down, status, up
from devstack.files import ENDPOINTS_FILE
from devstack.settings import (
    DEFAULT_REGISTRY_PORT,
    DEFAULT_S3_PORT,
    REGISTRY_PORT_ENV,
    S3_PORT_ENV,
    STACK_DIR_ENV,
    StackError,
    default_stack_dir,
)


def main(argv: list[str] | None = None) -> int:
    """`scripts/stack up|down|status`; exit 1 with one line on stderr when something fails."""
    parser = argparse.ArgumentParser(
        prog="scripts/stack",
        description="The local stack (S3, registry, Docker Engine) on 127.0.0.1. "
        f"Folder: ${STACK_DIR_ENV} or .stack/; ports: ${S3_PORT_ENV} "
        f"(default {DEFAULT_S3_PORT}), ${REGISTRY_PORT_ENV} (default {DEFAULT_REGISTRY_PORT}).",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("up", help="start what is not running, wait until it answers")
    commands.add_parser("down", help="stop what `up` started")
    commands.add_parser("status", help="one line per service: name, state, endpoint, pid")
    args = parser.parse_args(argv)
    try:
        if args.command == "up":
            up()
            print(f"endpoints: {default_stack_dir() / ENDPOINTS_FILE}")
        elif args.command == "down":
            down()
        for service in status():
            print(service.line())
    except StackError as error:
        print(f"stack: {error}", file=sys.stderr)
        return 1
    return 0
