"""Model locks: the source and, per file, name, size and sha256, as `weights/<model>.lock.yaml`."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Annotated

import yaml
from msgspec import Meta

from pipelines.core.errors import BadInput
from pipelines.core.files import write_atomic
from pipelines.core.paths import LOCKS_DIR
from pipelines.core.schema import Strict, as_data, load_yaml_model

SHA256_PATTERN = r"^[0-9a-f]{64}$"
# A plain file name of a model folder: no separator, not "." or "..", not hidden (staging's
# temporary names start with a dot).
FILE_NAME_PATTERN = r"^(?!\.)[A-Za-z0-9_.-]+$"
Sha256 = Annotated[str, Meta(pattern=SHA256_PATTERN)]
FileName = Annotated[str, Meta(pattern=FILE_NAME_PATTERN)]


class LockError(BadInput):
    """A lock that cannot be used."""


class LockEntry(Strict, frozen=True, kw_only=True):
    """One file: its name, and once locked, its size and sha256 (etag: the store's, for info)."""

    name: FileName
    size: Annotated[int, Meta(ge=0)] | None = None
    sha256: Sha256 | None = None
    etag: str | None = None

    @property
    def locked(self) -> bool:
        """True when size and hash are known."""
        return self.size is not None and self.sha256 is not None

    @property
    def locked_sha256(self) -> str:
        """The sha256 of a locked entry (fetch, stage and verify take only those)."""
        if self.sha256 is None:
            raise LockError(f"file {self.name!r}: no sha256; expected a locked entry")
        return self.sha256

    @property
    def locked_size(self) -> int:
        """The size of a locked entry."""
        if self.size is None:
            raise LockError(f"file {self.name!r}: no size; expected a locked entry")
        return self.size

    def __post_init__(self) -> None:
        """A hash without a size cannot be checked cheaply: refuse it."""
        if self.sha256 is not None and self.size is None:
            raise ValueError(f"file {self.name!r} has a sha256 but no size")


class Lock(Strict, frozen=True, kw_only=True):
    """A model's lock: where it comes from and what each file must be."""

    model: Annotated[str, Meta(pattern=r"^[a-z0-9][a-z0-9.-]*$")]
    source: Annotated[str, Meta(pattern=r"^s3://[^/]+/.+")]
    files: Annotated[list[LockEntry], Meta(min_length=1)]

    def __post_init__(self) -> None:
        """Every file appears once."""
        seen: set[str] = set()
        for entry in self.files:
            if entry.name in seen:
                raise ValueError(f"file {entry.name!r} is listed twice")
            seen.add(entry.name)

    def entry(self, name: str) -> LockEntry:
        """The entry of a file name."""
        for entry in self.files:
            if entry.name == name:
                return entry
        raise LockError(f"lock of {self.model}: no file {name!r}")

    def unlocked(self) -> list[str]:
        """Names of the entries without size or hash."""
        return [e.name for e in self.files if not e.locked]

    @property
    def size(self) -> int:
        """Bytes in all locked files."""
        return sum(e.size or 0 for e in self.files)


def cache_key(source: str) -> str:
    """The operator's model cache folder name: the first 16 hex of sha256(source)."""
    return hashlib.sha256(source.encode()).hexdigest()[:16]


def lock_path(model: str, folder: Path = LOCKS_DIR) -> Path:
    """The lock file of a model."""
    return folder / f"{model}.lock.yaml"


def load_lock(path: Path) -> Lock:
    """Read and validate a lock file, or raise LockError with one line."""
    return load_yaml_model(path, Lock, LockError)


def require_locked(lock: Lock, path: Path) -> None:
    """Refuse a lock with entries that have no hash (they can only be fetched to lock them)."""
    missing = lock.unlocked()
    if missing:
        raise LockError(
            f"{path}: files[{missing[0]!r}].sha256: not locked yet ({len(missing)} file(s));"
            f" run `doit lock_weights` against the source to fill it"
        )


def dump_lock(lock: Lock) -> str:
    """The YAML text of a lock: a header line, then one flow mapping per file."""
    lines = [
        f"# Lock of {lock.model}: written by `doit lock_weights`; every file's size and sha256.",
        f"model: {lock.model}",
        f"source: {lock.source}",
        "files:",
    ]
    for e in lock.files:
        fields = {k: v for k, v in as_data(e).items() if v is not None or k != "etag"}
        flow = yaml.safe_dump(fields, default_flow_style=True, sort_keys=False, width=1000)
        lines.append(f"  - {flow.strip()}")
    return "\n".join(lines) + "\n"


def write_lock(lock: Lock, path: Path) -> None:
    """Write a lock file atomically."""
    write_atomic(path, dump_lock(lock).encode())
