"""The pipeline's errors, each one line with an exit code CI can act on, and the one wrapper that
every `python -m` entry point runs under.

Exit codes (README, "Exit codes"): 1 a step failed, 2 bad input or configuration, 3 a service
unreachable or nothing to measure, 4 a gate found a regression, 5 a gate that cannot decide yet
(inconclusive), 6 `doit diff` found changes a deploy would make, 7 `doit status` found drift,
130 interrupted.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import NoReturn

INTERRUPTED = 130  # 128 + SIGINT: what a shell reports for a command stopped by Ctrl-C


class PipelineError(Exception):
    """A failure with one line a person can act on (file, field, what was expected)."""

    exit_code = 1  # a step failed


class BadInput(PipelineError):
    """A profile, lock, manifest, option or credential that is malformed: fix it, not retry."""

    exit_code = 2


class Unreachable(PipelineError):
    """A service that does not answer, or nothing there to measure: the world, not the input."""

    exit_code = 3


class DeployError(PipelineError):
    """A deployment that did not come up, or a world that would not let it (deploy, and the
    targets' engine and API clients that deploy and the fabric check share)."""


class DeployUnreachable(DeployError, Unreachable):
    """A member's Docker engine or the Kubernetes API server that does not answer at all."""


class Regression(PipelineError):
    """A gate measured and found a metric worse than its baseline allows."""

    exit_code = 4


class Inconclusive(PipelineError):
    """A gate measured, found no sure regression, but cannot say the run passed: more runs."""

    exit_code = 5


class ChangesPending(PipelineError):
    """`doit diff`: a deploy now would change something (as terraform's -detailed-exitcode)."""

    exit_code = 6


class Drift(PipelineError):
    """`doit status`: what runs was changed since the last deployment applied it."""

    exit_code = 7


def exit_with(err: PipelineError) -> NoReturn:
    """Print the error's `error:` line on stderr and exit with its code."""
    print(f"error: {err}", file=sys.stderr)
    sys.exit(err.exit_code)


def run_main(main: Callable[[], int | None]) -> NoReturn:
    """Exit with main's own status, or print one `error:` line and exit with the error's code."""
    try:
        status = main()
    except PipelineError as err:
        exit_with(err)
    except OSError as err:  # the disk's own, as the engine reports it in a step
        print(f"error: {type(err).__name__}: {err}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(INTERRUPTED)
    sys.exit(status or 0)
