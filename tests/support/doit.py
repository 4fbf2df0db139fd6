"""The one way the tests run doit: as a user does, `python -m doit` in a folder, output kept."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
# Long enough for a first build of local-sim on a busy 2-core machine; a hang still ends.
TIMEOUT_S = 600


def run_doit(
    *args: str,
    env: Mapping[str, str] | None = None,
    cwd: Path = REPO,
    timeout: float = TIMEOUT_S,
) -> subprocess.CompletedProcess[str]:
    """`python -m doit ARGS` in cwd (the checkout), in env (else this process's), finished."""
    return subprocess.run(
        [sys.executable, "-m", "doit", *args],
        cwd=cwd,
        env=dict(os.environ if env is None else env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
