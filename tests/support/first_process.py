"""A command run as the first process (PID 1) of a PID namespace of its own, as in its container,
where the kernel drops every signal that process has no handler for, and stopped as `docker
stop` stops it: SIGTERM from outside."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


@contextlib.contextmanager
def first_process(argv: list[str], **popen: Any) -> Iterator[subprocess.Popen[str]]:
    """argv as PID 1 of a new PID namespace (unshare's child); killed with it at the end."""
    process = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--kill-child", *argv], text=True, **popen
    )
    try:
        yield process
    finally:
        process.kill()
        process.wait()


def stop(process: subprocess.Popen[str], what: str, timeout: float) -> int:
    """SIGTERM to the command inside (once it has said it is up), then its exit status; a test
    failure naming what when it is still running after timeout seconds (it ignored the signal)."""
    children = Path(f"/proc/{process.pid}/task/{process.pid}/children").read_text().split()
    (inside,) = children
    os.kill(int(inside), signal.SIGTERM)
    try:
        return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{what} as PID 1 ignored SIGTERM for {timeout:g} s", pytrace=False)
