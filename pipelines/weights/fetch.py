"""Fetch locked files from S3 into a content-addressed blob store, hashing while bytes arrive.

Each file is split into ranges fetched in parallel on one shared pool into reused buffers; one
thread per file takes the ranges in order, feeds them to sha256 and appends them to the
partial file. The partial file is therefore always a verified-order prefix: a killed fetch
resumes from its length, reading that prefix back from local disk (not downloading it again)
to rebuild the hash. A file is renamed into the store only when its sha256 matches the lock.

One writer per file is deliberate: concurrent writes into one file contend on its inode lock,
which cost more CPU than the hashing itself on 2 cores (measured).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

import botocore.exceptions
import urllib3.exceptions

from pipelines.errors import PipelineError
from pipelines.progress import Progress
from pipelines.s3 import S3Url, describe_s3_error
from pipelines.statcache import StatCache, stat_key
from pipelines.store import fsync_dir
from pipelines.weights.lock import Lock, LockEntry

MiB = 1 << 20
READ_CHUNK = 4 * MiB
RETRYABLE = (
    botocore.exceptions.BotoCoreError,
    urllib3.exceptions.HTTPError,
    ConnectionError,
    TimeoutError,
)


class FetchError(PipelineError):
    """One or more files could not be fetched intact (one line per file)."""


class IncompleteRange(ConnectionError):
    """The server closed a range before all its bytes arrived."""


@dataclass(frozen=True)
class FetchOptions:
    """Tuning of a fetch; memory held is at most files_at_once x ahead x part_size."""

    part_size: int = 32 * MiB
    workers: int = 8
    files_at_once: int = 4
    ahead: int = 4
    max_rate: float | None = None  # bytes per second over all ranges, None for no limit
    retries: int = 5
    durable: bool = True  # fsync each file before it enters the store (survives power loss)


@dataclass
class FetchReport:
    """What a fetch did: files fetched and reused, failures, and bytes over the network."""

    fetched: list[str] = field(default_factory=list)
    reused: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    downloaded: int = 0
    read_back: int = 0


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


class BlobStore:
    """Blobs named by their sha256 (read-only), partial downloads, and staged model folders."""

    def __init__(self, root: Path, statcache: StatCache):
        self.root = Path(root)
        self.statcache = statcache
        self.blobs = self.root / "blobs" / "sha256"
        self.partial = self.root / "partial"
        self.models = self.root / "models"
        for folder in (self.blobs, self.partial, self.models):
            folder.mkdir(parents=True, exist_ok=True)

    def blob(self, sha256: str) -> Path:
        """The path of a blob."""
        return self.blobs / sha256

    def is_intact(self, sha256: str, size: int) -> bool:
        """True when the blob exists with its size and digest (a stat, unless never hashed)."""
        path = self.blob(sha256)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return False
        if st.st_size != size:
            return False
        cached = self.statcache.lookup(path.absolute(), st)
        if cached is None:
            cached = self.statcache.digest_file(path)
        return cached == sha256

    def missing(self, lock: Lock) -> list[LockEntry]:
        """Lock entries whose blob is absent or not intact."""
        return [e for e in lock.files if not self.is_intact(e.sha256, e.size)]

    def add_bytes(self, data: bytes) -> str:
        """Put a small blob made here (e.g. a patched config) into the store; returns its sha256."""
        sha = hashlib.sha256(data).hexdigest()
        if not self.is_intact(sha, len(data)):
            tmp = self.partial / f"{sha}.{os.getpid()}.new"
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            self._publish(tmp, sha)
        return sha

    def _publish(self, tmp: Path, sha256: str) -> None:
        """Make a verified temp file the blob of sha256: read-only, renamed, recorded."""
        os.chmod(tmp, 0o444)  # staged names are hard links to this inode: nobody writes it
        path = self.blob(sha256)
        os.rename(tmp, path)
        fsync_dir(self.blobs)
        self.statcache.record([(path.absolute(), stat_key(os.stat(path)), sha256)])

    @contextlib.contextmanager
    def locked(self, sha256: str) -> Iterator[None]:
        """Hold the fetch lock of one blob across processes."""
        with open(self.partial / f"{sha256}.lock", "w") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            yield


def plan_ranges(size: int, part_size: int) -> list[tuple[int, int]]:
    """Byte ranges [start, end) covering a file of size bytes."""
    return [(start, min(start + part_size, size)) for start in range(0, size, part_size)]


class Fetcher:
    """Fetches the missing files of one lock on a shared pool of range downloads."""

    def __init__(
        self, client, url: S3Url, blobs: BlobStore, options: FetchOptions, progress: Progress
    ):
        self.client = client
        self.url = url
        self.blobs = blobs
        self.options = options
        self.progress = progress
        self.limiter = RateLimiter(options.max_rate)
        self.report = FetchReport()
        self.stop = threading.Event()
        self._count = threading.Lock()
        self.pool = ThreadPoolExecutor(options.workers, thread_name_prefix="range")
        # Range buffers are reused: fresh big allocations cost a page fault per 4 KiB.
        self.buffers: queue.SimpleQueue[bytearray] = queue.SimpleQueue()
        for _ in range(options.files_at_once * options.ahead):
            self.buffers.put(bytearray(options.part_size))

    def fetch(self, entries: list[LockEntry]) -> FetchReport:
        """Fetch entries (biggest first, several files at once); failures are collected."""
        ordered = sorted(entries, key=lambda e: e.size, reverse=True)
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
            self.pool.shutdown(wait=True, cancel_futures=True)
        for name, outcome in outcomes.items():
            try:
                reused = outcome.result()
            except PipelineError as err:
                self.report.failed[name] = str(err)
                continue
            (self.report.reused if reused else self.report.fetched).append(name)
        return self.report

    def fetch_file(self, entry: LockEntry) -> bool:
        """Fetch one file into the blob store; True when it was already there."""
        sha = entry.sha256
        with self.blobs.locked(sha):
            if self.blobs.is_intact(sha, entry.size):
                self.progress.advance(entry.name, entry.size)
                return True
            part = self.blobs.partial / f"{sha}.part"
            fd = os.open(part, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                have = os.fstat(fd).st_size
                if have > entry.size:
                    os.ftruncate(fd, 0)
                    have = 0
                actual = self._stream(self.url.key(entry.name), entry, fd, have)
                if actual != sha:
                    part.unlink()
                    raise FetchError(
                        f"{entry.name}: sha256 mismatch: expected {sha}, got {actual} (not stored)"
                    )
                if self.options.durable:
                    os.fsync(fd)
            finally:
                os.close(fd)
            self.blobs._publish(part, sha)
            return False

    def _stream(self, key: str, entry: LockEntry, fd: int, have: int) -> str:
        """Hash the prefix already on disk, then download the rest in order; the sha256."""
        digest = hashlib.sha256()
        for start, end in plan_ranges(have, self.options.part_size):
            data = os.pread(fd, end - start, start)
            digest.update(data)
            with self._count:
                self.report.read_back += len(data)
            self.progress.advance(entry.name, len(data))
        ranges = [
            (have + a, have + b) for a, b in plan_ranges(entry.size - have, self.options.part_size)
        ]
        inflight: dict[int, Future] = {}
        submitted = 0
        try:
            for i, (start, _) in enumerate(ranges):
                while submitted < len(ranges) and submitted - i < self.options.ahead:
                    inflight[submitted] = self.pool.submit(
                        self._download_range, key, entry.name, *ranges[submitted]
                    )
                    submitted += 1
                buffer, view = inflight.pop(i).result()
                digest.update(view)
                while view:
                    written = os.pwrite(fd, view, start)
                    view, start = view[written:], start + written
                self.buffers.put(buffer)
            return digest.hexdigest()
        finally:
            for future in inflight.values():
                future.cancel()
            for future in inflight.values():
                with contextlib.suppress(BaseException):
                    self.buffers.put(future.result()[0])

    def _download_range(
        self, key: str, name: str, start: int, end: int
    ) -> tuple[bytearray, memoryview]:
        """GET one range into a pooled buffer, retrying dropped connections; (buffer, view)."""
        buffer = self.buffers.get()
        try:
            view = memoryview(buffer)[: end - start]
            attempt = 0
            while True:
                try:
                    self._get_range(key, name, start, view)
                    return buffer, view
                except botocore.exceptions.ClientError as err:
                    raise FetchError(describe_s3_error(err, key)) from None
                except RETRYABLE as err:
                    if attempt == self.options.retries:
                        raise FetchError(describe_s3_error(err, key)) from None
                    time.sleep(min(2**attempt * 0.2, 5))
                    attempt += 1
        except BaseException:
            self.buffers.put(buffer)
            raise

    def _get_range(self, key: str, name: str, start: int, view: memoryview) -> None:
        """Fill view with the object's bytes from start on, counting them as they arrive."""
        response = self.client.get_object(
            Bucket=self.url.bucket, Key=key, Range=f"bytes={start}-{start + len(view) - 1}"
        )
        got = 0
        counted = 0  # counting per READ_CHUNK, not per socket read, keeps the loop cheap
        try:
            with response["Body"] as body:
                readinto = direct_readinto(body, response)
                while got < len(view):
                    if self.stop.is_set():
                        raise FetchError(f"{key}: fetch stopped")
                    n = readinto(view[got : got + READ_CHUNK])
                    if not n:
                        break
                    got += n
                    if self.limiter.rate:
                        self.limiter.take(n)
                    if got - counted >= READ_CHUNK:
                        self._count_bytes(name, got - counted)
                        counted = got
        finally:
            self._count_bytes(name, got - counted)
        if got != len(view):
            raise IncompleteRange(f"got {got} of {len(view)} bytes")

    def _count_bytes(self, name: str, n: int) -> None:
        """Add n bytes that came over the network to the report and the progress."""
        with self._count:
            self.report.downloaded += n
        self.progress.advance(name, n)


def direct_readinto(body, response: dict) -> Callable[[memoryview], int]:
    """The fastest readinto for an S3 body: http.client's own, straight from the socket.

    botocore and urllib3 read through a temporary and copy it (measured: most of this fetch's
    CPU on 2 cores). Identity-encoded bodies can be read from the underlying http.client
    response; anything else falls back to the StreamingBody.
    """
    raw = getattr(body, "_raw_stream", None)
    http_response = getattr(raw, "_fp", None)
    encoding = response.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("content-encoding")
    if http_response is None or not hasattr(http_response, "readinto") or encoding:
        return body.readinto
    return http_response.readinto


def fetch_lock(
    client,
    lock: Lock,
    blobs: BlobStore,
    options: FetchOptions = FetchOptions(),
    progress_factory: Callable[[str, int, dict[str, int]], Progress] = Progress,
) -> FetchReport:
    """Fetch every file of a (fully locked) lock that the blob store lacks; raise on failures."""
    url = S3Url.parse(lock.source)
    missing = blobs.missing(lock)
    if not missing:
        return FetchReport(reused=[e.name for e in lock.files])
    total = sum(e.size for e in missing)
    big = {e.name: e.size for e in sorted(missing, key=lambda e: e.size, reverse=True)[:2]}
    progress = progress_factory(f"fetch {lock.model}", total, big)
    try:
        report = Fetcher(client, url, blobs, options, progress).fetch(missing)
    finally:
        progress.close()
    report.reused += [e.name for e in lock.files if e not in missing]
    if report.failed:
        raise FetchError("\n".join(report.failed.values()))
    return report
