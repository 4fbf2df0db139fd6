"""The local store: step outputs kept under their keys, written so they appear only complete."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import msgspec

from pipelines.core.errors import BadInput
from pipelines.core.files import (
    MiB,
    flock_held,
    fsync_dir,
    fsync_tree,
    load_json_object,
    write_atomic,
)
from pipelines.core.progress import say
from pipelines.engine.statcache import StatCache

# Folders the store keeps for itself; stages get their own through `area`.
OWN = ("steps", "tmp", "locks", "records")
# A step's record is its key material and input listings: a few KiB, some 1 MiB for a build
# context of thousands of files; a file past this is not one the store wrote.
RECORD_MAX_BYTES = 16 * MiB
# Every process that uses a store holds this file's flock shared for its whole life; `doit gc`
# takes it exclusive, so nothing a run has found done (and will read later) goes under it.
IN_USE = "in-use.lock"
# The process's one descriptor per store root: flocks of one process on one file would
# otherwise block each other when gc asks for the lock exclusive.
_IN_USE: dict[Path, int] = {}


class CorruptStepRecord(BadInput):
    """A step record that cannot be read: truncated, not JSON, or without a field explain uses."""


class StepFields(msgspec.Struct):
    """The fields of a step record that explain reads (the rest is kept as it is)."""

    key: str
    finished: float
    recipe: str = ""
    version: int = 0
    params: dict[str, Any] = {}
    inputs: dict[str, str] = {}
    deps: dict[str, str] = {}
    files: dict[str, dict[str, str]] = {}


class Store:
    """One folder of step outputs by key, with named areas, temp folders and a stat cache.

    It is also the local backend of the engine's cache interface (`has`, `publish`).
    """

    name = "store"

    def __init__(self, root: Path):
        self.root = Path(root).absolute()
        for sub in OWN:
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self.statcache = StatCache(self.root / "statcache.sqlite3")
        hold_in_use(self.root)

    def area(self, name: str) -> Path:
        """A folder of the store that one stage owns (its blobs, its layer cache), made on use."""
        if name in OWN or "/" in name or name.startswith("."):
            raise ValueError(f"store area {name!r}: reserved or not a plain name")
        folder = self.root / name
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    @contextlib.contextmanager
    def temp_dir(self, prefix: str) -> Iterator[Path]:
        """A fresh folder on the store's filesystem (renames into the store stay atomic)."""
        work = self.root / "tmp" / f"{prefix}.{os.getpid()}.{time.monotonic_ns()}"
        work.mkdir(parents=True)
        try:
            yield work
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def step_dir(self, key: str) -> Path:
        """Where the output and record of a key live once complete."""
        return self.root / "steps" / key

    def output_dir(self, key: str) -> Path:
        """The output folder of a key (exists only when the output is complete)."""
        return self.step_dir(key) / "out"

    def has(self, key: str) -> bool:
        """True when complete output for key is stored (its record a regular file)."""
        record = self.step_dir(key) / "step.json"
        return record.is_file() and not record.is_symlink()

    def publish(self, key: str, work: Path, record: dict[str, Any]) -> None:
        """Make a finished work folder (holding out/) the output of key: its files read-only and
        listed with their hashes in the record (what `changed` compares), fsync, then rename."""
        digest, files = self.statcache.tree_listing(work / "out")
        record = {**record, "outputs": {"tree": digest, "files": files}}
        for path in (work / "out").rglob("*"):
            if path.is_file() and not path.is_symlink():
                path.chmod(path.stat().st_mode & ~0o222)
        (work / "step.json").write_text(json.dumps(record, indent=2, sort_keys=True))
        fsync_tree(work)
        os.rename(work, self.step_dir(key))
        fsync_dir(self.step_dir(key).parent)

    def changed(self, key: str, fresh: bool = False) -> list[str]:
        """The output files of key that differ from what its record lists (changed, added,
        missing, unreadable), one entry each; [] when intact or made before outputs were listed.
        Unchanged files are answered by the stat cache (fresh: every file hashed again)."""
        try:
            listed = read_record(self.step_dir(key) / "step.json").get("outputs")
        except CorruptStepRecord as err:
            return [str(err)]
        if not isinstance(listed, dict) or not isinstance(listed.get("files"), dict):
            return []
        try:
            _, now = self.statcache.tree_listing(self.output_dir(key), fresh=fresh)
        except OSError as err:
            return [f"out: cannot be read ({err})"]
        before: dict[str, Any] = listed["files"]
        return sorted(
            [f"out/{n}: changed" for n in now if n in before and before[n] != now[n]]
            + [f"out/{n}: added" for n in now if n not in before]
            + [f"out/{n}: missing" for n in before if n not in now]
        )

    def set_aside(self, key: str) -> None:
        """Take key's stored output away, its builder's lock held."""
        with self.lock(key):
            self._take_away(key)

    def _take_away(self, key: str) -> None:
        """Rename key's folder into tmp/ and delete it there (the caller holds key's lock): a
        killed removal is a leftover the next builder of key deletes."""
        aside = self.root / "tmp" / f"{key}.changed-{os.getpid()}"
        with contextlib.suppress(FileNotFoundError):
            os.rename(self.step_dir(key), aside)
            shutil.rmtree(aside, ignore_errors=True)

    def clear_damaged(self, key: str) -> None:
        """Before key is built (its lock held): a folder of key whose record is no regular file
        (a FIFO, a link to a device, gone) is no output; said in one line and taken away, so
        that the new output can take its place."""
        folder = self.step_dir(key)
        if (folder.exists() or folder.is_symlink()) and not self.has(key):
            say("store", f"{folder}: no readable step.json; set aside, made again")
            self._take_away(key)

    def remember(self, record: dict[str, Any]) -> None:
        """Keep the record of a finished step (what `explain` compares against), any backend."""
        folder = self.root / "records" / quote(record["name"], safe="")
        write_atomic(folder / f"{record['key']}.json", json.dumps(record, sort_keys=True).encode())

    def has_record(self, name: str, key: str) -> bool:
        """True when the record of a step's key is kept."""
        return (self.root / "records" / quote(name, safe="") / f"{key}.json").is_file()

    def records_for(self, name: str) -> list[dict[str, Any]]:
        """Records of every finished run of a step, newest first."""
        folder = self.root / "records" / quote(name, safe="")
        if not folder.is_dir():
            return []
        records = [read_record(p) for p in folder.glob("*.json")]
        return sorted(records, key=lambda r: r["finished"], reverse=True)

    def readable_records(self, name: str) -> tuple[list[dict[str, Any]], list[str]]:
        """(records_for's records that can be read, one line for each that cannot)."""
        folder = self.root / "records" / quote(name, safe="")
        records, corrupt = [], []
        for path in folder.glob("*.json") if folder.is_dir() else ():
            try:
                records.append(read_record(path))
            except CorruptStepRecord as err:
                corrupt.append(str(err))
        return sorted(records, key=lambda r: r["finished"], reverse=True), sorted(corrupt)

    @contextlib.contextmanager
    def alone(self, who: str) -> Iterator[None]:
        """Be the only process using the store (others that hold it are waited for; new ones
        wait in Store()); shared again after. For gc: no run may have found done what it
        deletes."""
        fd = _IN_USE[self.root]
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(who, f"waiting for the other runs using {self.root} to finish")
            fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_SH)

    def is_building(self, key: str) -> bool:
        """True when a builder holds key's lock now (its step is in progress)."""
        return flock_held(self.root / "locks" / f"{key}.lock")

    @contextlib.contextmanager
    def lock(self, key: str) -> Iterator[None]:
        """Hold the build lock of a key (one builder per key, across processes)."""
        with open(self.root / "locks" / f"{key}.lock", "w") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def remove_leftovers(self, key: str) -> None:
        """Delete temp folders of key left by a killed builder (the caller holds key's lock)."""
        for stale in (self.root / "tmp").glob(f"{key}.*"):
            shutil.rmtree(stale, ignore_errors=True)

    def restore(self, key: str, fill: Callable[[Path], dict[str, Any] | None]) -> bool:
        """Publish under key what fill writes into a temp out/ folder (it verifies, and returns
        the record, or None when it has nothing): check, lock, check again, fill, rename."""
        if self.has(key):
            return True
        with self.lock(key):
            if self.has(key):
                return True
            self.remove_leftovers(key)
            self.clear_damaged(key)
            with self.temp_dir(key) as work:
                (work / "out").mkdir()
                record = fill(work / "out")
                if record is None:
                    return False
                self.publish(key, work, record)
            self.remember(record)
        return True

    def build(
        self,
        key: str,
        record: dict[str, Any],
        action: Callable[[Path], None],
        cache: Any = None,
    ) -> tuple[Path, bool]:
        """Run action into a temp folder and publish it under key in cache (default: here).

        Check, lock, check again, build, publish, record: a concurrent builder of the same key
        is waited for and its output used; a failure leaves nothing behind. (work, built).
        """
        cache = cache or self
        if cache.has(key):
            return self.output_dir(key), False
        with self.lock(key):
            if cache.has(key):
                return self.output_dir(key), False
            self.remove_leftovers(key)
            self.clear_damaged(key)
            with self.temp_dir(key) as work:
                (work / "out").mkdir()
                started = time.time()
                action(work / "out")
                full = {**record, "key": key, "started": started, "finished": time.time()}
                cache.publish(key, work, full)
            self.remember(full)
        return self.output_dir(key), True


def hold_in_use(root: Path) -> None:
    """Hold root's in-use flock shared for the life of this process (once per root), waiting
    while a gc has the store to itself."""
    if root in _IN_USE:
        return
    fd = os.open(root / IN_USE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        say("store", f"waiting for the gc of {root} to finish", stream=sys.stderr)
        fcntl.flock(fd, fcntl.LOCK_SH)
    _IN_USE[root] = fd


def read_record(path: Path) -> dict[str, Any]:
    """One step record, or CorruptStepRecord with one line naming the file (and field)."""
    return load_json_object(path, RECORD_MAX_BYTES, CorruptStepRecord, StepFields)
