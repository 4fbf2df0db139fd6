"""Layer normalization keeps what a file is (its extended attributes, a file capability among
them) and pins the rest: the same layer whatever order or extra records the builder wrote; what
deflates the layers is in every image key."""

from __future__ import annotations

import gzip
import io
import tarfile
import zlib
from pathlib import Path

import pytest
from support import stages

from pipelines.core.profiles import load_profile
from pipelines.engine.steps import Engine
from pipelines.engine.store import Store
from pipelines.stages.images import Images
from pipelines.stages.images.oci import normalize_layer

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


def test_another_zlib_gives_the_base_and_the_image_other_keys(tmp_path, monkeypatch):
    # Two zlib builds may deflate one tar into two byte strings: one key must not name both.
    monkeypatch.setattr(Images, "base_ref", lambda self: "registry/base@sha256:" + "0" * 64)

    def keys() -> tuple[str, str]:
        engine = Engine(Store(tmp_path / "store"))
        images = Images(stages.context(load_profile("local"), engine))
        assert images.base_step is not None  # local-sim's base is made here
        return engine.key(images.base_step), engine.key(images.image_step)

    base, image = keys()
    monkeypatch.setattr(zlib, "ZLIB_RUNTIME_VERSION", "1.3.1-other")
    other_base, other_image = keys()
    assert other_base != base and other_image != image


@pytest.mark.parametrize("tar_filter", ["data", "fully_trusted"])
def test_a_tar_is_extracted_on_a_python_without_tar_filters(tmp_path, monkeypatch, tar_filter):
    # Debian bookworm's python3 (3.11.2) predates PEP 706: no filters, no filter= argument.
    from pipelines.stages.images.oci import extract_tar

    made = tmp_path / "made.tar"
    with tarfile.open(made, "w") as tar:
        info = tarfile.TarInfo("etc/hello")
        info.size = 6
        tar.addfile(info, io.BytesIO(b"hello\n"))
    unfiltered = tarfile.TarFile.extractall

    def extractall_of_3_11_2(self, path=".", members=None, *, numeric_owner=False):
        return unfiltered(self, path, members, numeric_owner=numeric_owner, filter="fully_trusted")

    monkeypatch.delattr(tarfile, "data_filter")
    monkeypatch.setattr(tarfile.TarFile, "extractall", extractall_of_3_11_2)
    with tarfile.open(made) as tar:
        extract_tar(tar, tmp_path / "out", tar_filter)
    assert (tmp_path / "out" / "etc" / "hello").read_bytes() == b"hello\n"
