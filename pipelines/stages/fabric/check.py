"""Check saved NCCL logs by hand: `python -m pipelines.stages.fabric.check LOG... [--profile NAME]
[--expect P2P>=200]`; prints one line per failed expectation, exits 1 when any failed, 2 when
the logs, the profile or the expectation cannot be read."""

from __future__ import annotations

import argparse
from pathlib import Path

from pipelines.core.errors import BadInput, run_main
from pipelines.core.profiles import load_profile
from pipelines.core.progress import say
from pipelines.stages.fabric.expect import expectations_for, failures, parse_expectation
from pipelines.stages.fabric.nccllog import NcclLog, add_log


def main(argv: list[str] | None = None) -> int:
    """Parse the logs as one ring's, check them, print the verdict."""
    parser = argparse.ArgumentParser(prog="python -m pipelines.stages.fabric.check")
    parser.add_argument("logs", nargs="+", type=Path, help="one log per member (or one for all)")
    parser.add_argument("--profile", help="check against this ring profile's expectations")
    parser.add_argument("--expect", help="TRANSPORT[>=GBPS][:HCA,...], e.g. P2P>=200")
    args = parser.parse_args(argv)
    if bool(args.profile) == bool(args.expect):
        parser.error("give exactly one of --profile and --expect")
    if args.expect:
        expect = parse_expectation(args.expect)
    else:
        expect = expectations_for(load_profile(args.profile))
    log = NcclLog()
    for path in args.logs:
        try:
            add_log(log, path.read_text(errors="replace"))
        except OSError as err:  # a log named on the command line: the input, not the disk
            raise BadInput(str(err)) from None
    largest = log.largest
    measured = f"{largest.busbw:.2f} GB/s at {largest.size} bytes" if largest else "no busbw"
    transports = ", ".join(sorted(log.transports)) or "no channels"
    say("fabric", f"{transports}; {measured}")
    lines = failures(log, expect)
    for line in lines:
        say("fabric", line)
    say("fabric", f"{'failed' if lines else 'passed'} ({expect.transport})")
    return 1 if lines else 0


if __name__ == "__main__":
    run_main(main)
