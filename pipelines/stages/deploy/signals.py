"""SIGTERM and SIGHUP as a second Ctrl-C for the tasks that change a ring: they restore what
they changed.

A cancelled CI job or a timeout stops a process with SIGINT, then SIGTERM some seconds later
(GitHub's runner: 7.5 s; some of its versions send SIGHUP instead, actions/runner#1309), then
SIGKILL. Python raises KeyboardInterrupt on SIGINT, and dies on the others without running a
single `finally`. Within `terminate_as_interrupt` they raise Terminated, so a deploy stopped any
of these ways puts the previous containers back; within `restoring` they are ignored, so that
restore is not itself cut short by the signal that follows. A signal the process was started
ignoring (`nohup`) stays ignored.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any, NoReturn

STOPPING = (signal.SIGTERM, signal.SIGHUP)


class Terminated(BaseException):
    """SIGTERM or SIGHUP arrived: stop as Ctrl-C stops (a BaseException, as KeyboardInterrupt)."""


def _raise_terminated(signum: int, frame: FrameType | None) -> NoReturn:
    raise Terminated(signal.Signals(signum).name)


@contextlib.contextmanager
def _handled(handler: Callable[[int, FrameType | None], Any] | signal.Handlers) -> Iterator[None]:
    """STOPPING signals go to handler within (main thread only: elsewhere none can be set)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in STOPPING}
    for s, before in previous.items():
        if before is not signal.SIG_IGN:
            signal.signal(s, handler)
    try:
        yield
    finally:
        for s, before in previous.items():
            signal.signal(s, before)


def terminate_as_interrupt() -> contextlib.AbstractContextManager[None]:
    """Within, SIGTERM and SIGHUP raise Terminated in the main thread."""
    return _handled(_raise_terminated)


def restoring() -> contextlib.AbstractContextManager[None]:
    """Within, SIGTERM and SIGHUP are ignored: a restore under way runs to its end (or SIGKILL)."""
    return _handled(signal.SIG_IGN)
