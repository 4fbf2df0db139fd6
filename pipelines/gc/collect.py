"""Deleting what the plan frees, at the edge, each kind under the lock its writers take."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from pipelines.files import fsync_dir
from pipelines.gcplan import Verdict
from pipelines.store import Store
from pipelines.weights.stage import staging


def remove_tree(store: Store, path: Path) -> None:
    """Rename a folder into the store's tmp/ (one atomic step: it is whole or gone from where
    readers look), then delete it there."""
    if not path.exists():
        return
    grave = store.root / "tmp" / f"gc-{path.name}.{os.getpid()}"
    os.rename(path, grave)
    fsync_dir(path.parent)
    shutil.rmtree(grave, ignore_errors=True)


@contextlib.contextmanager
def every_staging_lock(weights: Path) -> Iterator[None]:
    """Hold the staging lock of every model folder (sorted: two holders never cross)."""
    with contextlib.ExitStack() as held:
        for folder in sorted((weights / "models").glob("*")):
            if folder.is_dir():
                held.enter_context(staging(folder))
        yield


def unlinked(blob: Path) -> bool:
    """True when no staged name links the blob (checked again under the staging locks)."""
    try:
        return os.stat(blob).st_nlink == 1
    except FileNotFoundError:
        return False


def collect(store: Store, weights: Path, verdicts: list[Verdict]) -> None:
    """Delete every item the plan frees; the caller has the store to itself."""
    dead = [v.item for v in verdicts if not v.alive]
    for item in (i for i in dead if i.kind in ("step", "layer", "tmp")):
        if not item.refs:  # the old layer cache folder: no builder writes there
            remove_tree(store, store.root / "layers")
            continue
        key = item.refs[0].split(":", 1)[1]
        path = store.step_dir(key) if item.kind != "tmp" else store.root / item.name
        with store.lock(key):  # a builder of the key would hold it
            remove_tree(store, path)
    blobs = [i for i in dead if i.kind == "blob"]
    if blobs:
        with every_staging_lock(weights):
            for item in blobs:
                path = weights / "blobs" / "sha256" / item.refs[0].removeprefix("blob:")
                if unlinked(path):
                    path.unlink()
        fsync_dir(weights / "blobs" / "sha256")
    for item in (i for i in dead if i.kind == "bench"):
        remove_tree(store, store.root / item.name)
