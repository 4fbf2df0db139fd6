"""Defences no other test held (issue 30): the blob server serves `/sha256/<64 hex>` names only,
and `doit verify_weights` re-hashes every blob whatever the stat cache says."""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import sqlite3
import tempfile
from pathlib import Path

import pytest
from support.doit import run_doit

from pipelines.core.modellock import load_lock, lock_path
from pipelines.engine.statcache import StatCache
from pipelines.stages.weights.blobs import BlobStore
from pipelines.stages.weights.blobserver import BlobServer
from pipelines.stages.weights.synthetic import (
    SHARDS,
    SyntheticShape,
    md5sums,
    shard_chunks,
    shard_name,
    small_files,
)

# --- the blob server's names ------------------------------------------------------------------


@pytest.fixture
def blob_folder():
    """A blobs folder the server's workers (nobody, the store being root's) may enter."""
    parent = Path(tempfile.mkdtemp(dir="/var/tmp"))
    parent.chmod(0o711)
    (parent / "blobs").mkdir()
    yield parent
    shutil.rmtree(parent)


def raw_get(path: str, port: int) -> tuple[int, bytes]:
    """GET path from a ring address, sent as written (HTTP clients normalize some paths)."""
    with socket.create_connection(("127.0.0.2", port), 5, ("127.0.0.3", 0)) as conn:
        conn.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        answer = b"".join(iter(lambda: conn.recv(65536), b""))
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def test_only_sha256_names_of_64_hex_digits_are_served(blob_folder):
    blobs = blob_folder / "blobs"
    data = os.urandom(5000)
    sha = hashlib.sha256(data).hexdigest()
    (blobs / sha).write_bytes(data)
    # Files in the blobs folder that are not blobs: each holds a marker that must not be served.
    planted = {
        f"{sha}.part": f"{sha}.part",  # a partial download's name
        f"sub/{sha}": f"sub/{sha}",  # a file in a subfolder
        sha.upper(): sha.upper(),  # upper-case hex
        sha[:63]: sha[:63],  # 63 digits
        sha + "0": sha + "0",  # 65 digits
        "g" * 64: "g" * 64,  # 64 characters, not hex
        ".statcache-clock": ".statcache-clock",  # a hidden file
    }
    for name in planted:
        (blobs / name).parent.mkdir(exist_ok=True)
        (blobs / name).write_bytes(b"NOT A BLOB " + name.encode())
    server = BlobServer(blobs, blob_folder / "ring", ("127.0.0.2",), ("127.0.0.3",), 18389)
    server.start()
    try:
        assert raw_get(f"/sha256/{sha}", 18389) == (200, data)
        for name in planted:
            status, body = raw_get(f"/sha256/{name}", 18389)
            assert status in (403, 404) and b"NOT A BLOB" not in body, (name, status, body)
    finally:
        server.stop()


# --- verify_weights past the stat cache -------------------------------------------------------

LOCK = "dsv41-flash-synthetic"


def write_synthetic_blobs(store: BlobStore) -> None:
    """The synthetic model's 54 files as blobs, made here (no S3), 0444 as fetch publishes."""
    shape = SyntheticShape()
    files = small_files(shape)
    files["MD5SUMS.body"] = md5sums(files, shape)
    for n in range(1, SHARDS + 1):
        files[shard_name(n)] = b"".join(shard_chunks(shape, n))
    for data in files.values():
        blob = store.blob(hashlib.sha256(data).hexdigest())
        blob.write_bytes(data)
        blob.chmod(0o444)


def test_verify_re_hashes_a_blob_the_stat_cache_still_vouches_for(tmp_path):
    store_root = tmp_path / "store"
    env = {**os.environ, "SPARKFORGE_STORE": str(store_root)}
    blobs = BlobStore(store_root / "weights", StatCache(tmp_path / "scratch.sqlite3"))
    write_synthetic_blobs(blobs)
    lock = load_lock(lock_path(LOCK))
    first = run_doit("verify_weights", "profile=local", env=env)
    assert first.returncode == 0, first.stdout + first.stderr

    # Bit rot as the disk does it: the bytes change, no stat field does. A process can restore
    # mtime but never ctime, so the store's stat cache is brought to the blob's new ctime: it
    # now vouches, by every stat field, for the digest the blob had (what a trusted cache holds
    # for a blob whose bytes the kernel never saw written).
    entry = lock.entry("tokenizer.json")
    blob = blobs.blob(entry.sha256).absolute()
    before = os.stat(blob)
    blob.chmod(0o644)
    with blob.open("r+b") as f:
        f.seek(10)
        f.write(b"\x00")
    blob.chmod(0o444)
    rotten = hashlib.sha256(blob.read_bytes()).hexdigest()
    os.utime(blob, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(blob)
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (
        before.st_size,
        before.st_mtime_ns,
        before.st_ino,
    )
    with sqlite3.connect(store_root / "statcache.sqlite3") as db:
        changed = db.execute(
            "UPDATE files SET ctime_ns = ? WHERE path = ? AND sha256 = ?",
            (after.st_ctime_ns, str(blob), entry.sha256),
        ).rowcount
    assert changed == 1  # the first verify recorded it
    assert StatCache(store_root / "statcache.sqlite3").lookup(blob, after) == entry.sha256

    verify = run_doit("verify_weights", "profile=local", env=env)
    out = verify.stdout + verify.stderr
    assert verify.returncode == 1, out
    assert (
        f"verify_weights: tokenizer.json: expected {entry.sha256}, got {rotten} (removed;"
        " `doit build` fetches them again)"
    ) in out
    assert not blob.exists()  # dropped: the next build fetches it again
