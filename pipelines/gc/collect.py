"""Deleting what the plan frees, at the edge, each kind under the lock its writers take."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from pipelines.core.files import fsync_dir
from pipelines.core.progress import say
from pipelines.engine.gcplan import Verdict
from pipelines.engine.store import Store
from pipelines.stages.weights.blobs import BlobStore
from pipelines.stages.weights.stage import staging, staging_lock


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


def remove_model_folder(folder: Path) -> None:
    """Delete a staged model folder under its staging lock, unless a stager holds it now (it
    is then being staged again: kept, said in one line)."""
    with open(staging_lock(folder), "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say("gc", f"kept weights/models/{folder.name}: a stager took it since the plan")
            return
        if folder.is_dir():
            # Hidden, as a stager's temp names: readers never find it half deleted.
            grave = folder.with_name(f".gc-{folder.name}.{os.getpid()}")
            os.rename(folder, grave)
            fsync_dir(folder.parent)
            shutil.rmtree(grave, ignore_errors=True)


def remove_partial(blobs: BlobStore, sha256: str) -> None:
    """Delete a partial download under the blob's writer flock, unless a fetch holds it now
    (it resumed since the plan: kept, said in one line)."""
    writer = blobs.try_writer(sha256)
    if writer is None:
        say("gc", f"kept weights/partial/{sha256[:16]}: a fetch took it since the plan")
        return
    with writer:
        blobs.partial_file(sha256).unlink(missing_ok=True)


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
    # Model folders before blobs: the blobs only they linked go in the same run.
    for item in (i for i in dead if i.kind == "model"):
        remove_model_folder(weights / "models" / item.refs[0].removeprefix("model:"))
    blobs = [i for i in dead if i.kind == "blob"]
    if blobs:
        with every_staging_lock(weights):
            for item in blobs:
                path = weights / "blobs" / "sha256" / item.refs[0].removeprefix("blob:")
                if unlinked(path):
                    path.unlink()
        fsync_dir(weights / "blobs" / "sha256")
    partials = [i.refs[0].removeprefix("partial:") for i in dead if i.kind == "partial"]
    if partials:
        store_of_blobs = BlobStore(weights, store.statcache)
        for sha in partials:
            remove_partial(store_of_blobs, sha)
    # No lock of their own: their one writer, the base image's step, runs in a doit that holds
    # the store, and the caller has it alone.
    for item in (i for i in dead if i.kind == "deb"):
        (store.root / "debs" / item.refs[0].removeprefix("deb:")).unlink(missing_ok=True)
    for item in (i for i in dead if i.kind == "bench"):
        remove_tree(store, store.root / item.name)
