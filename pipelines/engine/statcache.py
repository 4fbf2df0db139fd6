"""Content digests of files and folders, answered from a stat cache when a file did not change."""

from __future__ import annotations

import contextlib
import hashlib
import os
import sqlite3
import stat
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pipelines.core.errors import PipelineError
from pipelines.core.files import free_space_note, hash_file
from pipelines.engine.keys import canonical_json

# File timestamps come from a coarse kernel clock (a few ms per tick). An entry recorded within
# the same tick as the file's last change could miss a later same-size write in that tick, so
# recording waits until the file's ctime is at least this old (git calls this "racy clean").
RACY_NS = 50_000_000
# With a clock folder, how long recording waits for the filesystem to stamp a change later
# than the entries' (2 s covers the coarsest stamps, FAT's); past it nothing is recorded.
CLOCK_PATIENCE_S = 2.5

StatKey = tuple[int, int, int, int, int]


def stat_key(st: os.stat_result) -> StatKey:
    """The stat fields that change whenever a file's content can have changed."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def stamps_later_than(marker: Path, ctime_ns: int) -> bool:
    """Touch marker until its filesystem stamps it later than ctime_ns (False past patience).

    From then on any change to a file of that filesystem moves its ctime past ctime_ns, whatever
    the filesystem's clock and granularity: the racy-clean condition, read from the filesystem
    itself, as git reads it from its index file's mtime.
    """
    os.close(os.open(marker, os.O_WRONLY | os.O_CREAT, 0o644))
    give_up = time.monotonic() + CLOCK_PATIENCE_S
    while True:
        os.utime(marker)
        if os.stat(marker).st_ctime_ns > ctime_ns:
            return True
        if time.monotonic() > give_up:
            return False
        time.sleep(0.001)


class StatCache:
    """A persistent map (path, device, inode, size, mtime_ns, ctime_ns) -> sha256 in sqlite."""

    def __init__(self, db_path: Path):
        self.db_path = Path(db_path)
        self.db_path.parent.mkdir(parents=True, exist_ok=True)
        self._local = threading.local()
        try:
            with self._db() as db:
                db.execute(
                    "CREATE TABLE IF NOT EXISTS files (path TEXT PRIMARY KEY, dev INTEGER,"
                    " ino INTEGER, size INTEGER, mtime_ns INTEGER, ctime_ns INTEGER, sha256 TEXT)"
                )
                db.execute("CREATE INDEX IF NOT EXISTS files_inode ON files (dev, ino)")
        except sqlite3.Error as err:  # a full disk, a read-only one: one line, not a traceback
            raise PipelineError(
                f"{self.db_path}: cannot open the stat cache: {err}{free_space_note(self.db_path)}"
            ) from None

    def _db(self) -> sqlite3.Connection:
        # One connection per thread and process: a connection must not cross a fork
        # (doit -n forks workers after dodo.py opened the cache).
        if getattr(self._local, "pid", None) != os.getpid():
            db = sqlite3.connect(self.db_path, timeout=60)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            self._local.db, self._local.pid = db, os.getpid()
        db_now: sqlite3.Connection = self._local.db
        return db_now

    def close(self) -> None:
        """Close this thread's connection, if it has one: sqlite checkpoints the WAL into the
        database and removes its -wal and -shm files (a process that exits with the connection
        open leaves them, and a next open on a full disk fails to make them again)."""
        if getattr(self._local, "pid", None) == os.getpid():
            self._local.db.close()
        self._local = threading.local()

    def _db_device(self) -> int | None:
        """The device of the cache's folder (None if it cannot be read)."""
        try:
            return os.stat(self.db_path.parent).st_dev
        except OSError:
            return None

    def lookup(self, path: Path, st: os.stat_result) -> str | None:
        """The cached digest for path if its stat fields are unchanged, else None."""
        row = (
            self._db()
            .execute(
                "SELECT dev, ino, size, mtime_ns, ctime_ns, sha256 FROM files WHERE path = ?",
                (str(path),),
            )
            .fetchone()
        )
        if row and tuple(row[:5]) == stat_key(st):
            digest: str = row[5]
            return digest
        return None

    def record(
        self, entries: Iterable[tuple[Path, StatKey, str]], clock: Path | None = None
    ) -> None:
        """Remember digests for files whose stat did not move since they were hashed.

        clock: a folder of the files' own filesystem where a marker may be touched; recording
        then waits only until that filesystem stamps a change later than the files' (a tick at
        most, nothing on kernels with fine-grained stamps), not RACY_NS.
        """
        entries = list(entries)
        if not entries:
            return
        newest_ctime = max(key[4] for _, key, _ in entries)
        if clock is None and {key[0] for _, key, _ in entries} == {self._db_device()}:
            clock = self.db_path.parent  # the files' own filesystem: its stamps are their clock
        if clock is not None:
            try:
                later = stamps_later_than(clock / ".statcache-clock", newest_ctime)
            except OSError:  # a folder not ours to write: the fixed wait below is as safe
                clock = None
            else:
                if not later:
                    return  # a cache miss costs a hash; a stale entry would be trusted
        if clock is None:
            wait_ns = newest_ctime + RACY_NS - time.time_ns()
            if wait_ns > 0:
                time.sleep(wait_ns / 1e9)
        rows = []
        for path, key, sha in entries:
            try:
                if stat_key(os.stat(path)) != key:
                    continue
            except FileNotFoundError:
                continue
            rows.append((str(path), *key, sha))
        # A cache: a write the disk refuses (full) loses entries, and a miss costs a hash.
        with contextlib.suppress(sqlite3.Error), self._db() as db:
            db.executemany("INSERT OR REPLACE INTO files VALUES (?, ?, ?, ?, ?, ?, ?)", rows)

    def path_of_inode(self, st: os.stat_result) -> Path | None:
        """A cached path with the same device and inode as st (another name of the file)."""
        row = (
            self._db()
            .execute("SELECT path FROM files WHERE dev = ? AND ino = ?", (st.st_dev, st.st_ino))
            .fetchone()
        )
        return Path(row[0]) if row else None

    @contextlib.contextmanager
    def links_changing(self, paths: Iterable[Path]) -> Iterator[None]:
        """Keep the digests of paths across link/unlink of their inodes (ctime moves, bytes don't).

        Only entries valid right before are carried over, so no unverified change is laundered.
        """
        valid = {}
        for path in paths:
            with contextlib.suppress(FileNotFoundError):
                sha = self.lookup(path, os.stat(path))
                if sha:
                    valid[path] = sha
        yield
        self.record((path, stat_key(os.stat(path)), sha) for path, sha in valid.items())

    def digest_files(
        self, paths: Iterable[Path], workers: int | None = None, fresh: bool = False
    ) -> dict[Path, str]:
        """sha256 of each file: cached when its stat is unchanged (unless fresh), else hashed."""
        result: dict[Path, str] = {}
        misses: list[tuple[Path, StatKey]] = []
        for path in paths:
            path = Path(path).absolute()
            st = os.stat(path)
            if not stat.S_ISREG(st.st_mode):
                raise IsADirectoryError(f"{path}: expected a regular file")
            cached = None if fresh else self.lookup(path, st)
            if cached is None:
                misses.append((path, stat_key(st)))
            else:
                result[path] = cached
        if misses:
            workers = workers or os.cpu_count() or 1
            # Biggest first, so one huge file does not start last and set the wall time alone.
            misses.sort(key=lambda m: m[1][2], reverse=True)
            with ThreadPoolExecutor(max_workers=workers) as pool:
                digests = list(pool.map(lambda m: hash_file(m[0]), misses))
            self.record((path, key, sha) for (path, key), sha in zip(misses, digests, strict=True))
            result.update((path, sha) for (path, _), sha in zip(misses, digests, strict=True))
        return result

    def digest_file(self, path: Path) -> str:
        """sha256 of one file, through the cache."""
        return next(iter(self.digest_files([path]).values()))

    def digest_tree(self, root: Path, exclude: Iterable[str] = ()) -> str:
        """One digest for a folder: relative paths, executable bits, link targets, file digests."""
        return self.tree_listing(root, exclude)[0]

    def tree_listing(
        self, root: Path, exclude: Iterable[str] = (), fresh: bool = False
    ) -> tuple[str, dict[str, str]]:
        """(digest of the folder, relative path -> file digest or link target): a folder input's
        or a step output's (fresh: every file hashed again, past the cache)."""
        root = Path(root).absolute()
        skip = set(exclude)
        files: list[Path] = []
        entries: list[tuple[str, str, str | Path]] = []  # (path, kind, link target or file)
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d not in skip)
            for name in sorted(filenames):
                if name in skip:
                    continue
                path = Path(dirpath, name)
                rel = path.relative_to(root).as_posix()
                if path.is_symlink():
                    entries.append((rel, "link", os.readlink(path)))
                else:
                    files.append(path)
                    executable = bool(os.stat(path).st_mode & 0o111)
                    entries.append((rel, "x" if executable else "f", path))
        digests = self.digest_files(files, fresh=fresh)
        listing = [
            [rel, kind, digests[ref] if isinstance(ref, Path) else ref]
            for rel, kind, ref in entries
        ]
        digest = hashlib.sha256(canonical_json(sorted(listing))).hexdigest()
        return digest, {rel: value for rel, _, value in sorted(listing)}
