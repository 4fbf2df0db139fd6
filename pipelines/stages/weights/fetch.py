"""Fetch locked files from S3 into a content-addressed blob store, hashing while bytes arrive.

Each file is split into ranges fetched in parallel on one shared pool into reused buffers; one
thread per file takes the ranges in order and feeds them to sha256, and that file's writer
thread appends them behind it, in order, to the partial file (partial.py: direct to disk where
it can). The partial file is therefore always a verified-order prefix: a killed fetch resumes
from its length, reading that prefix back from local disk (not downloading it again) to
rebuild the hash. A file is renamed into the store only when its sha256 matches the lock and
its bytes are durable: the file's thread hands it to the publisher (publish.py), which makes
a whole batch durable with one filesystem sync, so no file waits for the disk on its own.

One writer per file is deliberate: concurrent writes into one file contend on its inode lock,
which cost more CPU than the hashing itself on 2 cores (measured).
"""

from __future__ import annotations

import contextlib
import hashlib
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pipelines.core.errors import PipelineError
from pipelines.core.modellock import Lock, LockEntry
from pipelines.core.progress import Progress, ProgressSink
from pipelines.stages.weights.blobs import BlobStore
from pipelines.stages.weights.options import FetchOptions
from pipelines.stages.weights.partial import (
    ALIGN,
    PartialFile,
    WriteBehind,
    WriteError,
    aligned_buffer,
)
from pipelines.stages.weights.publish import Publisher
from pipelines.stages.weights.ranges import SourceDown, Stopped
from pipelines.stages.weights.s3 import S3Url
from pipelines.stages.weights.sources import S3Source, Source

if TYPE_CHECKING:
    from types_boto3_s3 import S3Client


class FetchError(PipelineError):
    """One or more files could not be fetched intact (one line per file)."""


class LocalWriteError(FetchError):
    """This node could not write or read a fetched file (a full disk, EACCES): not its source's."""


@dataclass
class FetchReport:
    """What a fetch did: files fetched and reused, failures, and bytes over the network."""

    fetched: list[str] = field(default_factory=list)
    reused: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    downloaded: int = 0
    read_back: int = 0
    by_origin: dict[str, int] = field(default_factory=dict)  # downloaded, per kind of source
    halted: str | None = None  # why the whole fetch stopped (its source down), said once


class RateLimiter:
    """A token bucket shared by all ranges (for links that must not be saturated)."""

    def __init__(self, rate: float | None):
        self.rate = rate
        self._lock = threading.Lock()
        self._next = time.monotonic()

    def take(self, n: int) -> None:
        """Wait until n more bytes fit under the rate."""
        if not self.rate:
            return
        with self._lock:
            now = time.monotonic()
            self._next = max(self._next, now) + n / self.rate
            wait = self._next - now - n / self.rate
        if wait > 0:
            time.sleep(wait)


def plan_ranges(size: int, part_size: int, tapered: bool = False) -> list[tuple[int, int]]:
    """Byte ranges [start, end) covering a file of size bytes, part_size each; tapered, the
    last two to three part sizes of a file over four parts long go in quarter parts.

    A file is hashed in order, so its last ranges are hashed and written only after they have
    all arrived, and at the end of a fetch nothing overlaps that wait. Measured on 16 cores at
    10 Gbit/s: 71 ms from the link's last byte to the last file's last write, with 32 MiB
    ranges (a fifth of ours/s5cmd's 1.07). Quarters keep the alignment of direct writes.
    """
    cut = size
    if tapered and size > 4 * part_size:
        cut = (size - 2 * part_size) // part_size * part_size
    ranges = [(start, min(start + part_size, cut)) for start in range(0, cut, part_size)]
    quarter = max(ALIGN, part_size // 4 // ALIGN * ALIGN)
    return ranges + [(start, min(start + quarter, size)) for start in range(cut, size, quarter)]


def unmap_buffers(buffers: queue.SimpleQueue[memoryview]) -> None:
    """Let go of every range buffer (the last reference to one unmaps it)."""
    with contextlib.suppress(queue.Empty):
        while True:
            buffers.get_nowait()


class Fetcher:
    """Fetches the missing files of one lock on a shared pool of range downloads.

    A file comes from one source at a time (the bucket by default, a ring peer when named); the
    same verification, resume and publication hold whichever it is.
    """

    def __init__(
        self, source: Source, blobs: BlobStore, options: FetchOptions, progress: ProgressSink
    ):
        self.source = source
        self.blobs = blobs
        self.options = options
        self.progress = progress
        self.limiter = RateLimiter(options.max_rate)
        self.report = FetchReport()
        self.stop = threading.Event()
        self._count = threading.Lock()
        self.pool = ThreadPoolExecutor(options.workers, thread_name_prefix="range")
        self.publisher = Publisher(blobs, options.durable)
        self._touched: set[str] = set()  # blobs whose partial this fetch opened
        # Range buffers are reused (fresh big allocations cost a page fault per 4 KiB) and
        # page-aligned (direct writes to disk need that: partial.py).
        self.buffers: queue.SimpleQueue[memoryview] = queue.SimpleQueue()
        for _ in range(options.files_at_once * options.ahead):
            self.buffers.put(aligned_buffer(options.part_size))

    def fetch(self, entries: list[LockEntry]) -> FetchReport:
        """Fetch entries (biggest first, several files at once); failures are collected."""
        ordered = sorted(entries, key=lambda e: e.locked_size, reverse=True)
        files = ThreadPoolExecutor(self.options.files_at_once, thread_name_prefix="file")
        try:
            outcomes = {e.name: files.submit(self.fetch_file, e) for e in ordered}
            wait(outcomes.values())
        except BaseException:
            # Ctrl-C or a kill of the task: stop every range at its next read, then leave.
            self.stop.set()
            raise
        finally:
            files.shutdown(wait=True, cancel_futures=True)
            self.close()
        for name, outcome in outcomes.items():
            try:
                self.settle(name, outcome.result())
            except (Stopped, SourceDown) as err:
                if self.report.halted is None:
                    self.report.failed[name] = str(err)
            except PipelineError as err:
                self.report.failed[name] = str(err)
        return self.report

    def settle(self, name: str, published: Future[None] | None) -> None:
        """Wait for one fetched file's publication and record it (raises when it failed)."""
        if published is not None:
            published.result()
        (self.report.fetched if published else self.report.reused).append(name)

    def close(self) -> None:
        """Finish the range pool and publish everything verified (even after Ctrl-C)."""
        self.pool.shutdown(wait=True, cancel_futures=True)
        # Unmapping 1 GiB of buffers took 60 ms after the link's last byte (16 cores, 10
        # Gbit/s): a thread of its own does it while the last batch is published, and after.
        buffers, self.buffers = self.buffers, queue.SimpleQueue()
        threading.Thread(target=unmap_buffers, args=(buffers,), name="unmap", daemon=True).start()
        self.publisher.close()
        if self.publisher.sync_failed is not None:
            self.discard_partials()

    def discard_partials(self) -> None:
        """Remove the partial files of this fetch's unpublished files.

        After a sync failed, any page written (or read back) since the fetch began may be the
        one the disk lost, and no later sync reports an error already seen: a prefix kept for
        resume could be published wrong by the next fetch.
        """
        for sha in self._touched:
            if self.blobs.blob(sha).exists():
                continue
            writer = self.blobs.try_writer(sha)
            if writer is None:
                continue  # another process writes it now, under its own sync
            with writer:
                self.blobs.partial_file(sha).unlink(missing_ok=True)

    def fetch_file(self, entry: LockEntry, source: Source | None = None) -> Future[None] | None:
        """Fetch and verify one file; None when it was already stored, else its publication."""
        try:
            return self._fetch_file(entry, source or self.source)
        except OSError as err:
            # A local file that cannot be opened, read or cut (EACCES, EIO, a folder in its
            # place) fails this file in one line naming it; the other files go on. This node's
            # fault, not its source's: a ring peer is not refused for it.
            raise LocalWriteError(f"{entry.name}: {err}") from err

    def _fetch_file(self, entry: LockEntry, source: Source) -> Future[None] | None:
        sha = entry.locked_sha256
        writer = self.blobs.writer(sha)
        handed_over = False  # to the publisher, which closes it
        self._touched.add(sha)
        try:
            if self.blobs.is_intact(sha, entry.locked_size):
                self.progress.advance(entry.name, entry.locked_size)
                return None
            part = self.blobs.partial_file(sha)
            partial = PartialFile(part)
            try:
                try:
                    actual = self._stream(
                        source, entry, partial, partial.resume_point(entry.locked_size)
                    )
                except WriteError as err:
                    raise LocalWriteError(f"{entry.name}: {err}") from err
                if actual != sha:
                    part.unlink()
                    via = "" if source.origin == "s3" else f"from {source.label}; "
                    raise FetchError(
                        f"{entry.name}: sha256 mismatch: expected {sha}, got {actual}"
                        f" ({via}not stored)"
                    )
            finally:
                partial.close()
            # The publisher holds the flock from here on, until the file is in the store.
            published = self.publisher.submit(entry.name, part, sha, writer)
            handed_over = True
            return published
        finally:
            if not handed_over:
                writer.close()

    def _stream(self, source: Source, entry: LockEntry, partial: PartialFile, have: int) -> str:
        """Hash the prefix already on disk, then download the rest in order; the sha256."""
        digest = hashlib.sha256()
        for start, end in plan_ranges(have, self.options.part_size):
            if self.stop.is_set():  # a prefix of 100 GB takes minutes to read back
                raise Stopped(f"{entry.name}: fetch stopped")
            data = partial.read(start, end - start)
            digest.update(data)
            with self._count:
                self.report.read_back += len(data)
            self.progress.advance(entry.name, len(data))
        ranges = [
            (have + a, have + b)
            for a, b in plan_ranges(entry.locked_size - have, self.options.part_size, tapered=True)
        ]
        inflight: dict[int, Future[tuple[memoryview, memoryview]]] = {}
        submitted = 0
        writes = WriteBehind(partial, self.buffers.put)
        try:
            for i, (start, _) in enumerate(ranges):
                while submitted < len(ranges) and submitted - i < self.options.ahead:
                    inflight[submitted] = self.pool.submit(
                        self._download_range, source, entry, *ranges[submitted]
                    )
                    submitted += 1
                buffer, view = inflight.pop(i).result()
                digest.update(view)
                writes.write(buffer, view, start)
            writes.finish()
            return digest.hexdigest()
        finally:
            # Downloads first: on an error they stop taking the link while the writes drain.
            for future in inflight.values():
                future.cancel()
            for future in inflight.values():
                with contextlib.suppress(BaseException):
                    self.buffers.put(future.result()[0])
            writes.close()

    def _download_range(
        self, source: Source, entry: LockEntry, start: int, end: int
    ) -> tuple[memoryview, memoryview]:
        """Read one range from source into a pooled buffer (the source retries broken bodies)."""
        buffer = self.buffers.get()
        try:
            view = buffer[: end - start]
            source.read(
                entry,
                start,
                view,
                self.stop,
                lambda n: self._count_bytes(source.origin, entry.name, n),
                self.limiter.take if self.limiter.rate and source.origin == "s3" else None,
            )
            return buffer, view
        except SourceDown as err:
            # Every other file would fail alike, each after botocore's retries: stop them all.
            with self._count:
                self.report.halted = self.report.halted or str(err)
            self.stop.set()
            self.buffers.put(buffer)
            raise
        except BaseException:
            self.buffers.put(buffer)
            raise

    def _count_bytes(self, origin: str, name: str, n: int) -> None:
        """Add n bytes that came over the network to the report and the progress."""
        with self._count:
            self.report.downloaded += n
            self.report.by_origin[origin] = self.report.by_origin.get(origin, 0) + n
        self.progress.advance(name, n)


def fetch_lock(
    client: S3Client,
    lock: Lock,
    blobs: BlobStore,
    options: FetchOptions | None = None,
    progress_factory: Callable[[str, int, dict[str, int]], ProgressSink] = Progress,
) -> FetchReport:
    """Fetch every file of a (fully locked) lock that the blob store lacks; raise on failures."""
    options = options or FetchOptions()
    url = S3Url.parse(lock.source)
    missing = blobs.missing(lock)
    if not missing:
        return FetchReport(reused=[e.name for e in lock.files])
    total = sum(e.locked_size for e in missing)
    by_size = sorted(missing, key=lambda e: e.locked_size, reverse=True)
    big = {e.name: e.locked_size for e in by_size[:2]}
    progress = progress_factory(f"fetch {lock.model}", total, big)
    try:
        source = S3Source(client, url, options.retries)
        report = Fetcher(source, blobs, options, progress).fetch(missing)
    finally:
        progress.close()
    report.reused += [e.name for e in lock.files if e not in missing]
    lines = [report.halted] if report.halted else []
    if lines or report.failed:
        raise FetchError("\n".join([*lines, *report.failed.values()]))
    return report
