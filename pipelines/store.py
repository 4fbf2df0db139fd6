"""The local store: step outputs kept under their keys, written so they appear only complete."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

from pipelines.statcache import StatCache

STORE_ENV = "SPARKFORGE_STORE"
REPO_ROOT = Path(__file__).resolve().parent.parent


def default_store_root() -> Path:
    """The store folder: $SPARKFORGE_STORE, else `.store/` in the checkout."""
    return Path(os.environ.get(STORE_ENV) or REPO_ROOT / ".store").absolute()


def fsync_tree(root: Path) -> None:
    """Flush every file and folder below root to disk, so a rename publishes durable bytes."""
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            path = os.path.join(dirpath, name)
            if os.path.islink(path):
                continue
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


def fsync_dir(path: Path) -> None:
    """Flush a folder's entries (new names, renames) to disk."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Write a small file whole or not at all: temp file, fsync, rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


class Store:
    """One folder of step outputs by key, with a stat cache and doit's database beside them."""

    def __init__(self, root: Path | None = None):
        self.root = Path(root).absolute() if root else default_store_root()
        for sub in ("steps", "tmp", "locks", "index"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self.statcache = StatCache(self.root / "statcache.sqlite3")

    def step_dir(self, key: str) -> Path:
        """Where the output and record of a key live once complete."""
        return self.root / "steps" / key

    def output_dir(self, key: str) -> Path:
        """The output folder of a key (exists only when the output is complete)."""
        return self.step_dir(key) / "out"

    def has(self, key: str) -> bool:
        """True when complete output for key is stored."""
        return (self.step_dir(key) / "step.json").is_file()

    def record(self, key: str) -> dict[str, Any] | None:
        """The record written with the output of key, or None."""
        try:
            return json.loads((self.step_dir(key) / "step.json").read_text())
        except FileNotFoundError:
            return None

    def records_for(self, name: str) -> list[dict[str, Any]]:
        """Records of every stored output of a step, newest first."""
        folder = self.root / "index" / quote(name, safe="")
        if not folder.is_dir():
            return []
        records = [r for r in (self.record(k.name) for k in folder.iterdir()) if r]
        return sorted(records, key=lambda r: r["finished"], reverse=True)

    @contextlib.contextmanager
    def lock(self, key: str) -> Iterator[None]:
        """Hold the build lock of a key (one builder per key, across processes)."""
        with open(self.root / "locks" / f"{key}.lock", "w") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def build(
        self, key: str, record: dict[str, Any], action: Callable[[Path], None]
    ) -> tuple[Path, bool]:
        """Run action into a temp folder and publish it under key; (output, built) when done.

        A concurrent builder of the same key is waited for, then its output is used.
        """
        if self.has(key):
            return self.output_dir(key), False
        with self.lock(key):
            if self.has(key):
                return self.output_dir(key), False
            self._remove_leftovers(key)
            work = self.root / "tmp" / f"{key}.{os.getpid()}"
            (work / "out").mkdir(parents=True)
            started = time.time()
            try:
                action(work / "out")
                finished = time.time()
                full = {**record, "key": key, "started": started, "finished": finished}
                (work / "step.json").write_text(json.dumps(full, indent=2, sort_keys=True))
                fsync_tree(work)
                self._index(record["name"], key)
                os.rename(work, self.step_dir(key))
                fsync_dir(self.step_dir(key).parent)
            except BaseException:
                shutil.rmtree(work, ignore_errors=True)
                raise
        return self.output_dir(key), True

    def _index(self, name: str, key: str) -> None:
        """Note that name produced key (read by explain; entries without output are ignored)."""
        folder = self.root / "index" / quote(name, safe="")
        folder.mkdir(exist_ok=True)
        (folder / key).touch()

    def _remove_leftovers(self, key: str) -> None:
        """Delete temp folders of key left by a killed builder (we hold the key's lock)."""
        for stale in (self.root / "tmp").glob(f"{key}.*"):
            shutil.rmtree(stale, ignore_errors=True)
