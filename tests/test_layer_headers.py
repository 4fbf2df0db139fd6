"""Layer normalization keeps what a file is (its extended attributes, a file capability among
them) and pins the rest: the same layer whatever order or extra records the builder wrote."""

from __future__ import annotations

import gzip
import io
import tarfile
from pathlib import Path

from pipelines.images.oci import normalize_layer

# `setcap cap_net_bind_service+ep`: VFS_CAP_REVISION_2 with the effective flag, then permitted
# bit 10; the kernel's own 20-byte layout, not valid UTF-8 (as most capability values are not).
CAPABILITY = bytes.fromhex("0100000200040000000000000000000000000000")
CAP_RECORD = "SCHILY.xattr.security.capability"


def builder_layer(path: Path, records: dict[str, str]) -> Path:
    """A layer tar as a builder might write it: one file with these PAX records."""
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("usr/bin/server")
        info.size, info.mode, info.mtime = 5, 0o755, 1_700_000_000
        info.pax_headers = records
        tar.addfile(info, io.BytesIO(b"#!/x\n"))
    return path


def escaped(value: bytes) -> str:
    """A binary PAX value as tarfile holds it (surrogate escapes for what is not UTF-8)."""
    return value.decode("utf-8", "surrogateescape")


def normalized_records(blob: Path) -> dict[str, str]:
    """The PAX records of the one file in a normalized, gzipped layer."""
    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(blob.read_bytes()))) as tar:
        (member,) = tar.getmembers()
        return member.pax_headers


def test_a_file_capability_and_other_attributes_survive_normalization(tmp_path):
    records = {CAP_RECORD: escaped(CAPABILITY), "SCHILY.xattr.user.origin": "build"}
    blob, _ = normalize_layer(builder_layer(tmp_path / "in.tar", records), 1_600_000_000, tmp_path)
    kept = normalized_records(blob.path)
    assert kept == records
    assert kept[CAP_RECORD].encode("utf-8", "surrogateescape") == CAPABILITY


def test_attribute_order_and_times_the_builder_wrote_do_not_change_the_layer(tmp_path):
    one = {
        "SCHILY.xattr.user.b": "2",
        "SCHILY.xattr.user.a": "1",
        "LIBARCHIVE.xattr.user.c": "Mw==",
        "atime": "1700000123.25",
        "ctime": "1700000456.5",
    }
    other = dict(reversed(list(one.items())))
    other.update(atime="1800000000.75", ctime="1800000000.125")
    first, _ = normalize_layer(builder_layer(tmp_path / "a.tar", one), 1_600_000_000, tmp_path)
    second, _ = normalize_layer(builder_layer(tmp_path / "b.tar", other), 1_600_000_000, tmp_path)
    assert first.digest == second.digest
    assert list(normalized_records(first.path)) == [
        "LIBARCHIVE.xattr.user.c",
        "SCHILY.xattr.user.a",
        "SCHILY.xattr.user.b",
    ]
