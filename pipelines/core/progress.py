"""The one progress printer: plain lines (`say`, `transfer_line`) for every long job (fetch,
ring staging, bench, image builds), and a live display of a transfer on a terminal."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, TextIO

# rich draws the live display on a terminal, imported when one is shown: every module prints
# through this one, and listing the tasks draws nothing.
if TYPE_CHECKING:
    from rich.progress import Progress as RichProgress
    from rich.progress import TaskID

GiB = 1 << 30


def human_bytes(n: float) -> str:
    """Bytes as GiB/MiB with two decimals."""
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / (1 << 20):.1f} MiB"


def eta(seconds: float | None) -> str:
    """Seconds as H:MM:SS, or '?' when unknown."""
    if seconds is None:
        return "?"
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class ProgressSink(Protocol):
    """What long work reports its bytes to: a Progress, or NoProgress."""

    def advance(self, name: str, n: int) -> None:
        """Count n more bytes of the named file."""

    def close(self) -> None:
        """Stop showing."""


def say(prefix: str, text: str, stream: TextIO | None = None) -> None:
    """One plain line, `prefix: text`, flushed at once (a CI log shows it as it happens)."""
    print(f"{prefix}: {text}", file=sys.stdout if stream is None else stream, flush=True)


def show(text: str, stream: TextIO | None = None) -> None:
    """Text as it is, flushed: an indented line under a `say`, a table, a JSON report."""
    print(text, file=sys.stdout if stream is None else stream, flush=True)


def transfer_line(
    done: int, total: int, moved: int, took: float, sources: Sequence[tuple[str, int]] = ()
) -> str:
    """Bytes done of total and by source, the rate of the bytes moved, and the ETA at that rate
    (done may count bytes that were already there; only moved ones make the rate)."""
    rate = moved / took if took > 0 else 0.0
    left = max(total - done, 0) / rate if rate > 0 else None
    pct = 100 * done / total if total else 100.0
    text = f"{human_bytes(done)} / {human_bytes(total)} ({pct:.0f}%)"
    for name, count in sources:
        text += f", {human_bytes(count)} from {name}"
    return f"{text}, {rate / 1e6:.0f} MB/s, ETA {eta(left)}"


class Progress:
    """Counts bytes of a job and of its big files; shows them live or as a line every interval."""

    def __init__(
        self,
        label: str,
        total: int,
        big_files: dict[str, int] | None = None,
        stream: TextIO = sys.stderr,
        interval: float = 10.0,
    ):
        self.label, self.total, self.stream, self.interval = label, total, stream, interval
        self.done = 0
        self.per_file = {name: 0 for name in big_files or {}}
        self.sizes = dict(big_files or {})
        self.started = time.monotonic()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._rich: RichProgress | None = None
        if stream.isatty():
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                TextColumn,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )
            from rich.progress import Progress as RichProgress

            self._rich = RichProgress(
                TextColumn("{task.description}"),
                BarColumn(),
                DownloadColumn(binary_units=True),
                TransferSpeedColumn(),
                TimeRemainingColumn(),
                # The stream that was found to be a terminal: rich's default is stdout, which a
                # `| tee log` makes a pipe while the terminal shows nothing.
                console=Console(file=stream),
                transient=False,
            )
            self._tasks: dict[str | None, TaskID] = {None: self._rich.add_task(label, total=total)}
            for name, size in self.sizes.items():
                self._tasks[name] = self._rich.add_task(f"  {name}", total=size)
            self._rich.start()
        else:
            self._thread = threading.Thread(target=self._print_lines, daemon=True)
            self._thread.start()

    def advance(self, name: str, n: int) -> None:
        """Count n more bytes of file name."""
        with self._lock:
            self.done += n
            if name in self.per_file:
                self.per_file[name] += n
        if self._rich:
            self._rich.advance(self._tasks[None], n)
            if name in self._tasks:
                self._rich.advance(self._tasks[name], n)

    def line(self) -> str:
        """One plain line, less the label: bytes done of total, rate, ETA, and the big files."""
        took = max(time.monotonic() - self.started, 1e-9)
        text = transfer_line(self.done, self.total, self.done, took)
        bigs = [
            f"{name} {100 * done / max(self.sizes[name], 1):.0f}%"
            for name, done in self.per_file.items()
            if 0 < done < self.sizes[name]
        ]
        return text + (f" [{', '.join(bigs)}]" if bigs else "")

    def _print_lines(self) -> None:
        while not self._stop.wait(self.interval):
            say(self.label, self.line(), self.stream)

    def close(self) -> None:
        """Stop the display and print the closing line."""
        self._stop.set()
        if self._rich:
            self._rich.stop()
        else:
            say(self.label, self.line(), self.stream)


class NoProgress:
    """A Progress that shows nothing (for timing runs and tests)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def advance(self, name: str, n: int) -> None:
        """Ignore n bytes."""

    def close(self) -> None:
        """Nothing to close."""
