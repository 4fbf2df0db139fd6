"""Durable writes (pipelines/core/files.py): a file is written whole under a temp name of its own,
then renamed over (write_atomic) or linked in only where nothing is (create_once); a failed
write leaves no temp file behind."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from pipelines.core.files import create_once, write_atomic


def names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_write_atomic_replaces_the_file_with_a_new_inode_and_leaves_no_temp(tmp_path):
    path, link = tmp_path / "record.json", tmp_path / "linked"
    write_atomic(path, b"old")
    os.link(path, link)
    write_atomic(path, b"new", mode=0o600)
    assert path.read_bytes() == b"new" and link.read_bytes() == b"old"  # not written through
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert names(tmp_path) == ["linked", "record.json"]


def test_create_once_never_replaces_a_file_and_leaves_no_temp(tmp_path):
    path = tmp_path / "keys" / "local.key"
    create_once(path, b"first")
    create_once(path, b"second")
    assert path.read_bytes() == b"first"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert names(path.parent) == ["local.key"]


@pytest.mark.parametrize("write", [write_atomic, create_once], ids=["atomic", "once"])
def test_a_write_that_fails_leaves_neither_the_file_nor_a_temp(tmp_path, write):
    with pytest.raises(TypeError):
        write(tmp_path / "f", "not bytes")  # type: ignore[arg-type]
    assert names(tmp_path) == []
