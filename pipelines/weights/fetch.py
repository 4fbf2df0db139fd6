"""Fetch locked files from S3 into a content-addressed blob store, hashing while bytes arrive.

Each file is split into ranges fetched in parallel on one shared pool; ranges are written at
their offsets as they land, and one hasher per file feeds them to sha256 in order from memory.
A journal of finished ranges makes a killed fetch resumable: on the next run the finished
ranges are read back from local disk (not downloaded again) to rebuild the hash. A file is
renamed into the store only when its sha256 matches the lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
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
READ_CHUNK = 1 * MiB
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

    part_size: int = 16 * MiB
    workers: int = 16
    files_at_once: int = 4
    ahead: int = 6
    max_rate: float | None = None  # bytes per second over all ranges, None for no limit
    retries: int = 5


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


def read_journal(path: Path, count: int) -> set[int]:
    """Indexes of the ranges a previous run finished (a torn last line is ignored)."""
    try:
        lines = path.read_text().split("\n")
    except FileNotFoundError:
        return set()
    return {int(x) for x in lines[:-1] if x.isdigit() and int(x) < count}


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
        self._count = threading.Lock()
        self.pool = ThreadPoolExecutor(options.workers, thread_name_prefix="range")

    def fetch(self, entries: list[LockEntry]) -> FetchReport:
        """Fetch entries (biggest first, several files at once); failures are collected."""
        ordered = sorted(entries, key=lambda e: e.size, reverse=True)
        with ThreadPoolExecutor(self.options.files_at_once, thread_name_prefix="file") as files:
            outcomes = {e.name: files.submit(self.fetch_file, e) for e in ordered}
        self.pool.shutdown()
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
            journal = self.blobs.partial / f"{sha}.journal"
            ranges = plan_ranges(entry.size, self.options.part_size)
            done = read_journal(journal, len(ranges)) if part.exists() else set()
            if part.exists() and part.stat().st_size != entry.size:
                done = set()
            if not done:
                journal.unlink(missing_ok=True)
            fd = os.open(part, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                os.ftruncate(fd, entry.size)
                actual = self._stream_ranges(
                    self.url.key(entry.name), entry, fd, ranges, done, journal
                )
                if actual != sha:
                    part.unlink()
                    journal.unlink(missing_ok=True)
                    raise FetchError(
                        f"{entry.name}: sha256 mismatch: expected {sha}, got {actual} (not stored)"
                    )
                os.fsync(fd)
            finally:
                os.close(fd)
            self.blobs._publish(part, sha)
            journal.unlink(missing_ok=True)
            return False

    def _stream_ranges(
        self,
        key: str,
        entry: LockEntry,
        fd: int,
        ranges: list[tuple[int, int]],
        done: set[int],
        journal: Path,
    ) -> str:
        """Download the ranges not done, hashing every range in order; returns the sha256."""
        digest = hashlib.sha256()
        journal_fd = os.open(journal, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        inflight: dict[int, Future] = {}
        submitted = 0
        try:
            for i, (start, end) in enumerate(ranges):
                while submitted < len(ranges) and submitted - i < self.options.ahead:
                    if submitted not in done:
                        inflight[submitted] = self.pool.submit(
                            self._download_range,
                            key,
                            entry.name,
                            fd,
                            journal_fd,
                            submitted,
                            *ranges[submitted],
                        )
                    submitted += 1
                if i in done:
                    data = os.pread(fd, end - start, start)
                    with self._count:
                        self.report.read_back += len(data)
                    self.progress.advance(entry.name, len(data))
                else:
                    data = inflight.pop(i).result()
                digest.update(data)
            return digest.hexdigest()
        finally:
            # Ranges still in flight write into fd: let them finish before it is closed.
            for future in inflight.values():
                future.cancel()
            for future in inflight.values():
                with contextlib.suppress(BaseException):
                    future.result()
            os.close(journal_fd)

    def _download_range(
        self, key: str, name: str, fd: int, journal_fd: int, index: int, start: int, end: int
    ) -> bytes:
        """GET one range (retrying dropped connections), write it at its offset, journal it."""
        for attempt in range(self.options.retries + 1):
            try:
                data = self._get_range(key, name, start, end)
                break
            except botocore.exceptions.ClientError as err:
                raise FetchError(describe_s3_error(err, key)) from None
            except RETRYABLE as err:
                if attempt == self.options.retries:
                    raise FetchError(describe_s3_error(err, key)) from None
                time.sleep(min(2**attempt * 0.2, 5))
        view = memoryview(data)
        while view:
            written = os.pwrite(fd, view, start)
            view, start = view[written:], start + written
        os.write(journal_fd, f"{index}\n".encode())
        return data

    def _get_range(self, key: str, name: str, start: int, end: int) -> bytes:
        """The bytes [start, end) of an object, counted as they arrive."""
        response = self.client.get_object(
            Bucket=self.url.bucket, Key=key, Range=f"bytes={start}-{end - 1}"
        )
        body = response["Body"]
        buf = bytearray()
        try:
            while chunk := body.read(READ_CHUNK):
                self.limiter.take(len(chunk))
                buf += chunk
                with self._count:
                    self.report.downloaded += len(chunk)
                self.progress.advance(name, len(chunk))
        finally:
            body.close()
        if len(buf) != end - start:
            # Bytes of a broken range were counted as progress; take them back before a retry.
            self.progress.advance(name, -len(buf))
            raise IncompleteRange(f"got {len(buf)} of {end - start} bytes")
        return bytes(buf)


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
