"""Remote cache entries: the signed index of one step's output, made and checked.

An entry is `entries/<key>.json`: {"index": INDEX, "signer": PUBKEY, "signature": SIG} where
INDEX = {"format": 1, "key", "record": the step record, "files": [{"path", "size", "sha256",
"mode"}], "dirs": [...]} and SIG is the ed25519 signature of the canonical JSON of INDEX.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from pipelines.core.errors import PipelineError
from pipelines.core.files import hash_file
from pipelines.core.signing.namedkeys import PublicKey, SigningKey
from pipelines.engine.keys import canonical_json
from pipelines.engine.remote.signing import sign, verifies

FORMAT = 1
HEX64 = re.compile(r"[0-9a-f]{64}")
# An index lists a step's files: kilobytes for this pipeline's steps. A bigger object in a bucket
# others can write is refused before it is read (nor parsed into memory).
MAX_INDEX_BYTES = 4 << 20


class EntryRefused(PipelineError):
    """A remote entry that must not be used: the reason, in a few words."""


@dataclass(frozen=True)
class EntryFile:
    """One file of an output: where it goes, and what its bytes must be."""

    path: str
    size: int
    sha256: str
    mode: int


def output_files(out: Path) -> tuple[list[EntryFile], list[str]]:
    """(files, folders) of an output folder, sorted; anything but files and folders refused."""
    files, dirs = [], []
    for dirpath, dirnames, filenames in os.walk(out):
        dirnames.sort()
        for name in dirnames:
            dirs.append((Path(dirpath) / name).relative_to(out).as_posix())
        for name in sorted(filenames):
            path = Path(dirpath) / name
            rel = path.relative_to(out).as_posix()
            st = path.lstat()
            if not path.is_file() or path.is_symlink():
                raise PipelineError(f"{path}: only plain files can be cached remotely")
            files.append(EntryFile(rel, st.st_size, hash_file(path), st.st_mode & 0o777))
    return sorted(files, key=lambda f: f.path), dirs


def make_entry(
    key: str, record: dict[str, Any], files: list[EntryFile], dirs: list[str], signer: Any
) -> bytes:
    """The signed entry of key's output, as the bytes uploaded last."""
    assert isinstance(signer, SigningKey)
    index = {
        "format": FORMAT,
        "key": key,
        "record": record,
        "files": [vars(f) for f in files],
        "dirs": dirs,
    }
    envelope = {
        "index": index,
        "signer": signer.name,
        "signature": sign(signer, canonical_json(index)),
    }
    return json.dumps(envelope, sort_keys=True, indent=1).encode()


@dataclass(frozen=True)
class Entry:
    """A verified index: the record to keep, and the files and folders to restore."""

    record: dict[str, Any]
    files: list[EntryFile]
    dirs: list[str]
    signer: str


def check_entry(data: bytes, key: str, trusted: dict[str, PublicKey]) -> Entry:
    """The entry of key from its bytes, or EntryRefused: unreadable, untrusted, forged, altered."""
    if len(data) > MAX_INDEX_BYTES:
        raise EntryRefused(
            f"index of {len(data)} bytes or more, over the {MAX_INDEX_BYTES} allowed"
        )
    try:
        envelope = json.loads(data)
        index, signer, signature = envelope["index"], envelope["signer"], envelope["signature"]
    except (ValueError, TypeError, KeyError, RecursionError):  # RecursionError: nested too deep
        raise EntryRefused(
            f"index unreadable ({len(data)} bytes; truncated or not an entry)"
        ) from None
    if not isinstance(signer, str) or not isinstance(signature, str):
        raise EntryRefused("index has no signer or signature")
    if signer not in trusted:
        raise EntryRefused(f"signed by {signer}, a key not trusted here")
    try:
        message = canonical_json(index)
    except (TypeError, ValueError):
        raise EntryRefused("index is not canonical JSON") from None
    if not verifies(trusted[signer], message, signature):
        raise EntryRefused(f"signature does not verify against {signer} (forged or altered)")
    return parse_index(index, key, signer)


def parse_index(index: Any, key: str, signer: str) -> Entry:
    """The fields of a signed index, each checked (a trusted signer's mistakes are refused too)."""
    try:
        if index["format"] != FORMAT:
            raise EntryRefused(f"index format {index['format']!r}, expected {FORMAT}")
        if index["key"] != key or index["record"].get("key") != key:
            raise EntryRefused("index is for another key")
        files = [
            EntryFile(safe_path(f["path"]), f["size"], f["sha256"], f["mode"])
            for f in index["files"]
        ]
        dirs = [safe_path(d) for d in index["dirs"]]
    except (KeyError, TypeError, AttributeError):
        raise EntryRefused("index lacks a field") from None
    for f in files:
        if not (isinstance(f.size, int) and f.size >= 0 and HEX64.fullmatch(str(f.sha256))):
            raise EntryRefused(f"index: bad size or sha256 for {f.path}")
        if not isinstance(f.mode, int) or f.mode & ~0o777:
            raise EntryRefused(f"index: bad mode for {f.path}")
    if len({f.path for f in files} | set(dirs)) != len(files) + len(dirs):
        raise EntryRefused("index names a path twice")
    file_paths = {f.path for f in files}
    for path in [*file_paths, *dirs]:
        inside = next((str(p) for p in PurePosixPath(path).parents if str(p) in file_paths), None)
        if inside is not None:
            raise EntryRefused(f"index: path {path!r} is inside {inside!r}, which is a file")
    record = dict(index["record"])
    # The record is written under records/<name>/ and sorted by when it finished.
    name, finished = record.get("name"), record.get("finished")
    if not isinstance(name, str) or name in ("", ".", ".."):
        raise EntryRefused(f"index: record name {str(name)[:80]!r}: expected a step's name")
    if isinstance(finished, bool) or not isinstance(finished, int | float):
        finished = math.nan
    if not math.isfinite(finished):
        raise EntryRefused("index: record finished: expected a time in seconds")
    return Entry(record, files, dirs, signer)


def safe_path(path: Any) -> str:
    """A relative path inside the output folder, or EntryRefused."""
    if not isinstance(path, str) or not path or "\\" in path or "\0" in path:
        raise EntryRefused(f"index: bad path {path!r}")
    pure = PurePosixPath(path)
    if pure.is_absolute() or any(p in ("", ".", "..") for p in path.split("/")):
        raise EntryRefused(f"index: path {path!r} leaves the output folder")
    return pure.as_posix()
