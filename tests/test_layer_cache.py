"""The layer cache remembers a layer tar's normalized diff_id by the tar's stat (device, inode,
size, mtime, ctime): a tar handed back unchanged is not read again before the store lookup; a
changed tar, another epoch or a bad remembered row is read again; the key stays the diff_id."""

from __future__ import annotations

import io
import sqlite3
import sys
import tarfile
from pathlib import Path

import pytest

from pipelines.images.layer_cache import LayerCache
from pipelines.store import Store

WATCHED: dict[str, int] = {}  # path -> opens seen since the test started watching it


def count_opens(event: str, args: tuple[object, ...]) -> None:
    if event == "open" and isinstance(args[0], str) and args[0] in WATCHED:
        WATCHED[args[0]] += 1


# The interpreter's own audit events see every open of the file, whoever makes it.
sys.addaudithook(count_opens)


@pytest.fixture
def opens():
    def watch(path: Path) -> None:
        WATCHED[str(path.absolute())] = 0

    yield watch
    WATCHED.clear()


def write_layer(path: Path, payload: bytes) -> Path:
    """A builder's layer tar: one file, stamped later than the epochs the tests use."""
    with tarfile.open(path, "w") as tar:
        info = tarfile.TarInfo("etc/hello")
        info.size, info.mtime = len(payload), 1_700_000_000
        tar.addfile(info, io.BytesIO(payload))
    return path


def test_a_tar_handed_back_unchanged_is_not_read_again_and_a_changed_one_is(tmp_path, opens):
    store, tar = Store(tmp_path / "store"), write_layer(tmp_path / "layer.tar", b"hello\n")
    opens(tar)
    blob, diff_id, how = LayerCache(store).normalize(tar, 0)
    assert how == "normalized" and WATCHED[str(tar)] > 0
    opens(tar)
    again = LayerCache(store).normalize(tar, 0)  # the next build, the same tar
    assert again == (blob, diff_id, "found") and WATCHED[str(tar)] == 0
    # The same size, other bytes, written in place: its ctime and mtime move, so it is read.
    write_layer(tar, b"HELLO\n")
    _, changed, how = LayerCache(store).normalize(tar, 0)
    assert how == "normalized" and changed != diff_id and WATCHED[str(tar)] > 0


def test_another_epoch_is_not_answered_from_the_memo(tmp_path):
    store, tar = Store(tmp_path / "store"), write_layer(tmp_path / "layer.tar", b"hello\n")
    LayerCache(store).normalize(tar, 0)
    _, later, _ = LayerCache(store).normalize(tar, 1_600_000_000)
    _, fresh, _ = LayerCache(Store(tmp_path / "fresh")).normalize(tar, 1_600_000_000)
    assert later == fresh


@pytest.mark.parametrize("row", ["garbage", "sha256:" + "0" * 64], ids=["not a digest", "untagged"])
def test_a_bad_remembered_row_is_read_again(tmp_path, opens, row):
    store, tar = Store(tmp_path / "store"), write_layer(tmp_path / "layer.tar", b"hello\n")
    blob, diff_id, _ = LayerCache(store).normalize(tar, 0)
    with sqlite3.connect(store.root / "layer-diff-ids" / "statcache.sqlite3") as db:
        assert db.execute("UPDATE files SET sha256 = ?", (row,)).rowcount == 1
    opens(tar)
    assert LayerCache(store).normalize(tar, 0) == (blob, diff_id, "found")
    assert WATCHED[str(tar)] > 0
