"""How long this process itself stopped running while a cell was measured.

A thread that asks to wake every few milliseconds wakes late only when the process was not
scheduled (a starved CPU, a stopped process, swapping): the latest it woke is how long the
client could not read its streams. Tokens that arrived meanwhile are read in a burst, which
makes ITL and per-stream rates the client's, not the server's.
"""

from __future__ import annotations

import threading
import time
from types import TracebackType

TICK_S = 0.01
# A client late by this much has measured itself: its cell is reported, not gated. Well above
# what a busy interpreter's thread switching (5 ms) adds, well below the stalls that matter.
STALL_LIMIT_S = 1.0


class StallWatch:
    """A ticker thread for a with-block; worst is the longest it woke late, in seconds."""

    def __init__(self, tick: float = TICK_S) -> None:
        self.tick = tick
        self.worst = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stall-watch", daemon=True)

    def _run(self) -> None:
        last = time.perf_counter()
        while not self._stop.wait(self.tick):
            now = time.perf_counter()
            self.worst = max(self.worst, now - last - self.tick)
            last = now

    def __enter__(self) -> StallWatch:
        self._thread.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join()


def stall_note(summary: dict[str, object]) -> str | None:
    """Why a cell's timings are the client's, not the server's; None when it kept up."""
    stalled = summary.get("client_stall_s")
    if isinstance(stalled, (int, float)) and stalled >= STALL_LIMIT_S:
        return (
            f"the client stalled {stalled:.1f} s (this process was not running; tokens read"
            " late, in bursts): not gated, run it again on a machine with CPU to spare"
        )
    return None
