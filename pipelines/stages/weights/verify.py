"""`doit verify_weights`: every blob of the lock hashed again now, past the stat cache."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from pipelines.core.errors import PipelineError
from pipelines.core.modellock import Lock
from pipelines.core.progress import say
from pipelines.stages.weights.blobs import BlobStore


def verify_model(
    lock: Lock, lock_name: str, blobs: BlobStore, folder: Path, staged: Callable[[], bool]
) -> None:
    """Re-hash every blob of the lock (in parallel); remove bad ones and their staged names,
    then PipelineError naming each; PipelineError too when the staged folder differs."""
    paths = {e.name: blobs.blob(e.locked_sha256).absolute() for e in lock.files}
    digests = blobs.statcache.digest_files(
        [path for path in paths.values() if path.exists()], fresh=True
    )
    bad = [e for e in lock.files if digests.get(paths[e.name]) != e.sha256]
    for e in bad:
        # Neither the blob nor a staged name of its inode may be trusted again.
        for path in (folder / e.name, paths[e.name]):
            path.unlink(missing_ok=True)
    if bad:
        raise PipelineError(
            "verify_weights: "
            + "; ".join(
                f"{e.name}: expected {e.sha256}, got {digests.get(paths[e.name], 'no blob')}"
                for e in bad
            )
            + " (removed; `doit build` fetches them again)"
        )
    if folder.exists() and not staged():
        raise PipelineError(
            f"verify_weights: {folder} differs from the lock; run `doit stage_weights`"
        )
    say("verify_weights", f"{len(lock.files)} files re-hashed, all match {lock_name}")
