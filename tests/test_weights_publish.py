"""Batched publication of fetched blobs: synced before renamed, never published wrong, resumable."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import test_weights
from support.model_bucket import fetch
from test_weights_partial import cached_bytes, direct_io_here

from pipelines.core.files import sync_files
from pipelines.core.modellock import Lock
from pipelines.core.schema import as_data
from pipelines.engine import statcache
from pipelines.stages.weights import publish as publish_module
from pipelines.stages.weights.fetch import FetchError
from pipelines.stages.weights.partial import ALIGN


class RecordingSync:
    """Stands in for sync_files: notes what each call covered and what was published then."""

    def __init__(self, blob_store, sizes: dict[str, int], pause: float = 0.0, fail: bool = False):
        self.blobs, self.sizes, self.pause, self.fail = blob_store, sizes, pause, fail
        self.calls: list[tuple[list[str], set[str]]] = []

    def __call__(self, anchor_fd: int, paths: list[Path]) -> None:
        published = set(os.listdir(self.blobs.blobs))
        shas = [path.name.removesuffix(".part") for path in paths]
        for path, sha in zip(paths, shas, strict=True):
            assert path.stat().st_size == self.sizes[sha], "a file synced before it was whole"
        self.calls.append((shas, published))
        if self.fail:
            raise OSError(errno.EIO, "syncfs: Input/output error")
        time.sleep(self.pause)  # files finished meanwhile gather into the next batch
        sync_files(anchor_fd, paths)


def test_a_verified_file_enters_the_store_only_after_a_sync_covering_it(
    s3, synthetic, blobs, monkeypatch
):
    _, lock = synthetic
    sync = RecordingSync(blobs, {e.sha256: e.size for e in lock.files}, pause=1.0)
    monkeypatch.setattr(publish_module, "sync_files", sync)
    report = fetch(s3, lock, blobs)
    assert sorted(report.fetched) == sorted(e.name for e in lock.files)
    synced = [sha for shas, _ in sync.calls for sha in shas]
    assert sorted(synced) == sorted(e.sha256 for e in lock.files)  # each once, then published
    for shas, published in sync.calls:
        assert not set(shas) & published  # none of a batch was in the store before its sync
    assert len(sync.calls) < len(lock.files) / 2  # batches, not a wait per file
    assert blobs.missing(lock) == []


def test_a_failed_sync_publishes_nothing_of_its_batch_and_the_next_fetch_completes(
    s3, synthetic, blobs, monkeypatch
):
    _, lock = synthetic
    shards = Lock(
        model=lock.model,
        source=lock.source,
        files=[e for e in lock.files if e.name.startswith("model-0000")][:3],
    )
    failing = RecordingSync(blobs, {e.sha256: e.size for e in shards.files}, fail=True)
    monkeypatch.setattr(publish_module, "sync_files", failing)
    with pytest.raises(FetchError) as err:
        fetch(s3, shards, blobs)
    # The batch that heard of the error, then (no sync trusted again) every later batch.
    heard = "[Errno 5] syncfs: Input/output error"
    lines = dict(line.split(": not stored: ", 1) for line in str(err.value).split("\n"))
    assert sorted(lines) == sorted(e.name for e in shards.files)
    assert set(lines.values()) <= {heard, f"an earlier sync of this fetch failed ({heard})"}
    assert len(failing.calls) == 1
    assert os.listdir(blobs.blobs) == []
    # Bytes that may not have reached the disk are not trusted as a prefix to resume from.
    assert not any(blobs.partial_file(e.sha256).exists() for e in shards.files)

    monkeypatch.setattr(publish_module, "sync_files", sync_files)
    report = fetch(s3, shards, blobs)
    assert report.downloaded == sum(e.size for e in shards.files)
    assert blobs.missing(shards) == []


def test_after_a_failed_sync_no_partial_of_the_fetch_is_kept_to_resume_from(
    s3, synthetic, blobs, monkeypatch
):
    """A prefix written or read back in a fetch whose sync failed may be what the disk lost."""
    _, lock = synthetic
    shard = next(e for e in lock.files if e.name.startswith("model-0000"))
    # Locked, with a prefix from an earlier run on disk, but gone from the bucket: it fails.
    gone = shard.__class__(name="gone.safetensors", size=1 << 20, sha256="e" * 64)
    prefix = blobs.partial_file(gone.sha256)
    prefix.write_bytes(b"p" * ALIGN)
    failing = RecordingSync(blobs, {shard.sha256: shard.size}, fail=True)
    monkeypatch.setattr(publish_module, "sync_files", failing)
    with pytest.raises(FetchError) as err:
        fetch(s3, Lock(model=lock.model, source=lock.source, files=[shard, gone]), blobs)
    assert "gone.safetensors: " in str(err.value) and len(failing.calls) == 1
    assert not prefix.exists()
    assert not blobs.partial_file(shard.sha256).exists()


def test_after_a_failed_sync_a_file_handed_over_later_is_not_published(blobs, monkeypatch):
    """syncfs reports a writeback error once, for the whole filesystem: the file whose bytes
    failed may be one handed over after the batch that heard of it, and its own sync succeeds."""
    failures = [OSError(errno.EIO, "syncfs: Input/output error")]

    def fails_once(anchor_fd: int, paths: list[Path]) -> None:
        if failures:
            raise failures.pop()
        sync_files(anchor_fd, paths)

    monkeypatch.setattr(publish_module, "sync_files", fails_once)
    publisher = publish_module.Publisher(blobs, durable=True)
    outcomes = {}
    for name, data in (("a.bin", b"first"), ("b.bin", b"second")):
        sha = hashlib.sha256(data).hexdigest()
        writer = blobs.writer(sha)
        part = blobs.partial_file(sha)
        part.write_bytes(data)
        outcomes[name] = (publisher.submit(name, part, sha, writer), part)
        with pytest.raises(publish_module.PublishError) as err:
            outcomes[name][0].result(timeout=10)  # one batch each: b comes after a failed
    publisher.close()
    assert failures == []
    assert str(err.value) == (
        "b.bin: not stored: an earlier sync of this fetch failed"
        " ([Errno 5] syncfs: Input/output error)"
    )
    assert os.listdir(blobs.blobs) == []
    assert not any(part.exists() for _, part in outcomes.values())


def test_without_durability_files_are_published_with_no_sync(s3, synthetic, blobs, monkeypatch):
    """SPARKFORGE_FETCH_FSYNC=0: verified files are renamed in at once, nothing waits for disk."""
    _, lock = synthetic
    sync = RecordingSync(blobs, {e.sha256: e.size for e in lock.files})
    monkeypatch.setattr(publish_module, "sync_files", sync)
    small = Lock(model=lock.model, source=lock.source, files=lock.files[:5])
    report = fetch(s3, small, blobs, durable=False)
    assert sorted(report.fetched) == sorted(e.name for e in small.files)
    assert sync.calls == []
    assert blobs.missing(small) == []


# The killed fetches' rate: slow enough that 20 kills never let one finish (at 4 MB/s a run of
# long sleeps on a quiet machine did: seed 2280904949).
RATE = 2e6


def test_fetch_killed_at_random_points_never_leaves_a_wrong_blob_and_resumes(
    s3, synthetic, blobs, tmp_path, stack_env
):
    _, lock = synthetic
    lock_file = tmp_path / "model.lock.yaml"
    lock_file.write_text(json.dumps(as_data(lock)))
    seed = random.randrange(1 << 32)
    chance = random.Random(seed)
    argv = [sys.executable, "-c", test_weights.KILLABLE_FETCH, lock_file, blobs.root]
    for kill in range(20):
        proc = subprocess.Popen(
            [*argv, blobs.statcache.db_path, str(RATE)],
            env={**os.environ, **stack_env},
            cwd=test_weights.REPO,
        )
        # The interpreter starts in about a second: some kills land before any byte, most in
        # the fetch. At RATE the model (98.6 MB) takes 49 s, more than the 20 kills can leave
        # it (48 s at most, each less the start, plus a range's worth of bytes per run).
        time.sleep(chance.uniform(0.8, 2.4))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        for name in os.listdir(blobs.blobs):
            digest = hashlib.sha256((blobs.blobs / name).read_bytes()).hexdigest()
            assert digest == name, f"seed {seed}, kill {kill}: published blob {name} is wrong"

    missing = blobs.missing(lock)
    assert missing, f"seed {seed}: the fetch finished before the last kill"
    have = {
        e.sha256: os.path.getsize(p)
        for e in missing
        if (p := blobs.partial_file(e.sha256)).exists()
    }
    report = fetch(s3, lock, blobs)
    assert report.read_back == sum(have.values()), f"seed {seed}"
    assert report.downloaded == sum(e.size for e in missing) - report.read_back, f"seed {seed}"
    assert sorted(report.fetched) == sorted(e.name for e in missing)
    assert blobs.missing(lock) == []


def test_a_fetch_writes_its_blobs_to_disk_past_the_page_cache(s3, synthetic, blobs, tmp_path):
    """Direct writes (partial.py): the bytes go from the range buffers to the disk, not through
    a second copy into the page cache, which the sync would then have to write back."""
    if not direct_io_here(tmp_path):
        pytest.skip(f"{tmp_path}: no direct I/O on this filesystem")
    _, lock = synthetic
    big = sorted(lock.files, key=lambda e: e.size)[-2:]
    fetch(s3, Lock(model=lock.model, source=lock.source, files=big), blobs, part_size=1 << 20)
    for entry in big:
        assert entry.size > 16 * ALIGN
        assert cached_bytes(blobs.blob(entry.sha256)) <= ALIGN, entry.name  # the tail's page


def test_publication_waits_for_the_stores_clock_not_a_fixed_racy_ns(blobs, monkeypatch):
    # The fixed wait (50 ms) was the last thing every fetch waited for; the store's own stamps
    # answer within a tick. With RACY_NS at 10 s, a fixed wait would take 10 s here.
    monkeypatch.setattr(statcache, "RACY_NS", 10_000_000_000)
    began = time.monotonic()
    sha = blobs.add_bytes(b"published just now")
    assert time.monotonic() - began < 5
    blob = blobs.blob(sha)
    assert blobs.statcache.lookup(blob.absolute(), os.stat(blob)) == sha  # recorded, not skipped
