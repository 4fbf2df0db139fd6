"""What the edge tells the weights stage: where blobs live and how a node fetches."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipelines.core.settings import Settings

MiB = 1 << 20


@dataclass(frozen=True)
class FetchOptions:
    """Tuning of a fetch; memory held is at most files_at_once x ahead x part_size.

    Those buffers are shared by ranges in flight and ranges waiting to be written, so a disk
    slower than the link holds the downloads back instead of filling memory.
    """

    part_size: int = 32 * MiB
    # Eight files at once: a file held up by a slow stretch of disk (its direct writes queue
    # behind it, partial.py) must not leave the link idle. Measured at 2.5 Gbit/s, before the
    # writes went behind the hash, 5 alternating runs: 17.7 s against 19.7 s with 4 files and
    # 8 workers (s5cmd 16.7 s); at 10 Gbit/s 14.9 s against 15.7 s.
    workers: int = 16
    files_at_once: int = 8
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
