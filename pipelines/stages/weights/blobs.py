"""The blob store: model files named by their sha256, partial downloads, and staged folders."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import IO

from pipelines.core.files import fsync_dir, sha256_bytes, write_atomic
from pipelines.core.modellock import Lock, LockEntry
from pipelines.engine.statcache import StatCache, stat_key


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

    def partial_file(self, sha256: str) -> Path:
        """Where the download of a blob grows (always a prefix of the blob)."""
        return self.partial / f"{sha256}.part"

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
        return self.missing_entries(lock.files)

    def missing_entries(self, entries: list[LockEntry]) -> list[LockEntry]:
        """Entries whose blob is absent or not intact."""
        return [e for e in entries if not self.is_intact(e.locked_sha256, e.locked_size)]

    def add_bytes(self, data: bytes) -> str:
        """Put a small blob made here (e.g. a patched config) into the store; returns its sha256."""
        sha = sha256_bytes(data)
        if not self.is_intact(sha, len(data)):
            tmp = self.partial / f"{sha}.{os.getpid()}.new"
            write_atomic(tmp, data, mode=0o444)
            self.publish(tmp, sha)
        return sha

    def publish(self, verified: Path, sha256: str) -> None:
        """Make a verified, durable file the blob of sha256: read-only, renamed, recorded."""
        self.publish_many([(verified, sha256)])

    def publish_many(self, verified: list[tuple[Path, str]]) -> None:
        """Make verified, durable files blobs (read-only, renamed), one folder fsync for all."""
        recorded = []
        for path, sha256 in verified:
            os.chmod(path, 0o444)  # staged names are hard links to this inode: nobody writes it
            blob = self.blob(sha256)
            os.rename(path, blob)
            recorded.append((blob.absolute(), stat_key(os.stat(blob)), sha256))
        fsync_dir(self.blobs)
        # The partial folder shares the blobs' filesystem: its clock, not a fixed wait, says
        # when the entries are safe (the fixed 50 ms was the last thing every fetch waited for).
        self.statcache.record(recorded, clock=self.partial)

    def writer(self, sha256: str) -> IO[str]:
        """Become the only process writing the blob of sha256: an flock held until closed."""
        f = open(self.partial / f"{sha256}.writer", "w")  # noqa: SIM115 (closed by its owner)
        try:
            fcntl.flock(f, fcntl.LOCK_EX)
        except BaseException:
            f.close()
            raise
        return f

    def try_writer(self, sha256: str) -> IO[str] | None:
        """The writer's flock of sha256 if no other process holds it now, else None."""
        f = open(self.partial / f"{sha256}.writer", "w")  # noqa: SIM115 (closed by its owner)
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            return None
        except BaseException:
            f.close()
            raise
        return f
