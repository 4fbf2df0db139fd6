"""What the edge tells the weights stage: where blobs live and how a node fetches."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipelines.core.settings import Settings

MiB = 1 << 20


def cores() -> int:
    """How many CPUs this process may run on (its affinity, as a cpuset sets it; not a quota)."""
    return len(os.sched_getaffinity(0))


@dataclass(frozen=True)
class FetchOptions:
    """Tuning of a fetch; memory held is at most files_at_once x ahead x part_size.

    Those buffers are shared by ranges in flight and ranges waiting to be written, so a disk
    slower than the link holds the downloads back instead of filling memory.
    """

    part_size: int = 32 * MiB
    # Four ranges and two files per CPU this process may run on, up to 16 ranges of 8 files
    # (1 GiB of buffers). Eight files at once, where there are cores for them: a file held up by
    # a slow stretch of disk (its direct writes queue behind it, partial.py) must not leave the
    # link idle (2.5 Gbit/s, before the writes went behind the hash, 5 alternating runs: 17.7 s
    # against 19.7 s with 4 files and 8 ranges). On 2 CPUs the threads of 16 ranges and the
    # cold buffers they cycle cost CPU and fill the link no sooner (tests/perf/fetch.py's
    # synthetic model, 4.45 GB, medians of 3, 2026-12-07; 8 ranges of 4 files against 16 of 8):
    # at 2.5 Gbit/s into memory 15.4 s against 15.9, client CPU 2.38 s/GB against 3.19; onto
    # disk 15.2 s against 15.1, 1.62 against 2.03; at 10 Gbit/s into memory 8.8 s against 10.8,
    # 2.09 against 3.07.
    workers: int = field(default_factory=lambda: min(16, 4 * cores()))
    files_at_once: int = field(default_factory=lambda: min(8, 2 * cores()))
    ahead: int = 4
    max_rate: float | None = None  # bytes per second over all ranges, None for no limit
    retries: int = 5
    durable: bool = True  # files enter the store only once on disk (a sync per batch)


@dataclass(frozen=True)
class WeightsSettings:
    """The blob store's folder and the fetch tuning of this node."""

    root: Path
    fetch: FetchOptions = field(default_factory=FetchOptions)

    @classmethod
    def of(cls, settings: Settings, default_root: Path) -> WeightsSettings:
        """This node's blob folder and fetch tuning: the environment's, else the defaults."""
        default = FetchOptions()
        mib = settings.fetch_part_mib
        fetch = FetchOptions(
            part_size=int(mib * MiB) if mib else default.part_size,
            workers=settings.fetch_workers or default.workers,
            max_rate=settings.fetch_max_mbps * 1e6 if settings.fetch_max_mbps else None,
            durable=settings.fetch_durable,
        )
        return cls(settings.weights or default_root, fetch)
