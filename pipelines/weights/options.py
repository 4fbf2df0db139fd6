"""What the edge tells the weights stage: where blobs live and how a node fetches."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

MiB = 1 << 20


@dataclass(frozen=True)
class FetchOptions:
    """Tuning of a fetch; memory held is at most files_at_once x ahead x part_size."""

    part_size: int = 32 * MiB
    workers: int = 8
    files_at_once: int = 4
    ahead: int = 4
    max_rate: float | None = None  # bytes per second over all ranges, None for no limit
    retries: int = 5
    durable: bool = True  # files enter the store only once on disk (a sync per batch)


@dataclass(frozen=True)
class WeightsSettings:
    """The blob store's folder and the fetch tuning of this node."""

    root: Path
    fetch: FetchOptions = field(default_factory=FetchOptions)
