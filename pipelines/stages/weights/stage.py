"""Stage a model folder `<models>/<cacheKey>/` as hard links to verified blobs."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import secrets
from collections.abc import Iterator
from pathlib import Path

from pipelines.core.errors import PipelineError
from pipelines.core.files import fsync_dir, read_capped, write_atomic
from pipelines.core.modellock import FILE_NAME_PATTERN, SHA256_PATTERN, Lock
from pipelines.stages.weights.blobs import BlobStore


class StageError(PipelineError):
    """A model folder that cannot be staged."""


def stage_plan(lock: Lock, overrides: dict[str, str] | None = None) -> dict[str, str]:
    """File name -> blob sha256 of the staged folder: the lock, with patched files swapped in."""
    plan = {e.name: e.locked_sha256 for e in lock.files}
    plan.update(overrides or {})
    return plan


def stale_names(
    folder: Path, plan: dict[str, str], blobs: BlobStore
) -> tuple[list[str], list[str]]:
    """(names to (re)link, names to remove), decided by stat alone: same inode as the blob."""
    relink = []
    for name, sha in plan.items():
        try:
            staged = os.stat(folder / name)
        except FileNotFoundError:
            relink.append(name)
            continue
        blob = os.stat(blobs.blob(sha))
        if (staged.st_dev, staged.st_ino) != (blob.st_dev, blob.st_ino):
            relink.append(name)
    extra = sorted(set(os.listdir(folder)) - set(plan)) if folder.is_dir() else []
    return relink, extra


def staged_record(folder: Path) -> Path:
    """Beside a staged folder: the sha256 of the lock it was staged from (what a deploy's
    preflight checks on each member; inside the folder it would be a name the plan lacks)."""
    return folder.with_name(f"{folder.name}.staged.json")


def staging_lock(folder: Path) -> Path:
    """Beside a staged folder: the file whose flock one stager at a time holds."""
    return folder.with_name(f"{folder.name}.staging.lock")


@contextlib.contextmanager
def staging(folder: Path) -> Iterator[None]:
    """Be the only one staging folder (processes, threads, containers on this host), waiting
    for another; the kernel lets go of the flock when its holder dies."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(staging_lock(folder), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def temp_name() -> str:
    """A name of this stager's own to link through: hidden, so a plan never holds it and the
    next stager removes it if a kill leaves it behind."""
    return f".{os.getpid()}.{secrets.token_hex(8)}.staging"


def record_staged(folder: Path, lock_sha256: str) -> None:
    """Say, atomically, which lock the folder now holds (replacing whatever was there)."""
    record = {"lock_sha256": lock_sha256}
    path = staged_record(folder)
    try:
        write_atomic(path, (json.dumps(record, sort_keys=True) + "\n").encode())
    except OSError as err:  # a folder put where the record goes: one line, not a traceback
        raise PipelineError(f"{path}: cannot record the staged lock: {err.strerror}") from None


# A record is one sha256 in JSON: anything longer is not one.
RECORD_MAX_BYTES = 4096


def staged_from(folder: Path) -> str | None:
    """The sha256 of the lock the folder was last staged from, if recorded; None when there is
    no record or it is no small regular file of that shape (a FIFO or a device there is not
    waited on): the folder is then staged again, which writes the record anew."""
    path = staged_record(folder)
    if not os.path.lexists(path):
        return None
    try:
        lock_sha256 = json.loads(read_capped(path, RECORD_MAX_BYTES, PipelineError))["lock_sha256"]
    except (PipelineError, ValueError, RecursionError, KeyError, TypeError):
        return None
    return lock_sha256 if isinstance(lock_sha256, str) else None


def is_staged(folder: Path, plan: dict[str, str], blobs: BlobStore) -> bool:
    """True when the folder is exactly the plan (stats only, no bytes read)."""
    check_plan(folder, plan)
    if not folder.is_dir():
        return False
    relink, extra = stale_names(folder, plan, blobs)
    return not relink and not extra


def check_plan(folder: Path, plan: dict[str, str]) -> None:
    """Refuse a plan whose names are not plain file names or whose blobs are not sha256 hex:
    plans come from a lock, a patch's overrides restored from a cache, or a ring plan."""
    for name, sha in plan.items():
        if not re.match(FILE_NAME_PATTERN, str(name)):
            raise StageError(
                f"{folder}: file name {name!r} in the staging plan: expected a plain file name"
                " (letters, digits, '_', '.', '-'; not starting with '.')"
            )
        if not re.match(SHA256_PATTERN, str(sha)):
            raise StageError(f"{folder}: file {name!r}: blob {sha!r}: expected 64 hex digits")


def stage(
    folder: Path, plan: dict[str, str], blobs: BlobStore, lock_sha256: str | None = None
) -> list[str]:
    """Make folder exactly the plan, each name replaced atomically, and record lock_sha256 (if
    given) beside it, holding the folder's staging lock throughout; returns the names linked.

    Check, lock, check again: what to link is decided under the lock, so a stager that waited
    for another links only what is still stale (nothing, when both stage one plan).
    """
    check_plan(folder, plan)
    missing = [n for n, sha in plan.items() if not blobs.blob(sha).exists()]
    if missing:
        raise StageError(f"{folder}: blob of {missing[0]!r} is not in the store; fetch first")
    with staging(folder):
        folder.mkdir(exist_ok=True)
        relink, extra = stale_names(folder, plan, blobs)
        # Linking and unlinking move a blob's ctime: carry its verified digest across.
        touched = {blobs.blob(plan[name]).absolute() for name in relink}
        for name in relink + extra:
            with contextlib.suppress(FileNotFoundError):
                old = blobs.statcache.path_of_inode(os.stat(folder / name))
                if old is not None:
                    touched.add(old)
        with blobs.statcache.links_changing(touched):
            link_names(folder, plan, blobs, relink, extra)
        if lock_sha256 is not None:
            record_staged(folder, lock_sha256)
    return relink


def link_names(
    folder: Path, plan: dict[str, str], blobs: BlobStore, relink: list[str], extra: list[str]
) -> None:
    """Replace each name in relink by a hard link to its blob, and remove the extra names."""
    tmp = folder / temp_name()
    for name in relink:
        try:
            os.link(blobs.blob(plan[name]), tmp)
        except OSError as err:
            if err.errno == errno.EXDEV:
                raise StageError(
                    f"{folder}: on another filesystem than the blob store {blobs.root};"
                    " staging needs hard links (never symlinks)"
                ) from None
            raise
        os.replace(tmp, folder / name)
    for name in extra:
        path = folder / name
        if path.is_dir():
            raise StageError(f"{path}: unexpected folder in a staged model")
        path.unlink()
    fsync_dir(folder)
