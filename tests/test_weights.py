"""Weights against the real local S3: lock from the bucket, fetch, resume, verify and stage; what
a fetch reports, and the blob store's layout."""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import json
import os
import pty
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest
import urllib3.response
from keying import read_chars
from support.first_process import first_process, stop
from support.model_bucket import fetch, fresh_source
from support.ports import spare_ports

from pipelines.core.errors import INTERRUPTED, PipelineError
from pipelines.core.modellock import (
    Lock,
    cache_key,
    load_lock,
    lock_path,
)
from pipelines.core.progress import NoProgress
from pipelines.core.schema import as_data, replace
from pipelines.engine.statcache import StatCache
from pipelines.stages.weights import fetch as fetch_module
from pipelines.stages.weights import sources as sources_module
from pipelines.stages.weights.blobs import BlobStore
from pipelines.stages.weights.fetch import FetchError, fetch_lock, plan_ranges
from pipelines.stages.weights.options import FetchOptions
from pipelines.stages.weights.ranges import direct_readinto, fill
from pipelines.stages.weights.ringplan import RingNode, plan_json, plan_ring
from pipelines.stages.weights.s3 import S3Url
from pipelines.stages.weights.sources import S3Source
from pipelines.stages.weights.stage import is_staged, stage, stage_plan
from pipelines.stages.weights.synthetic import (
    config_json,
    model_names,
)

REPO = Path(__file__).resolve().parent.parent
BIG = "model-00047-of-00048.safetensors"
CONFIG_HEAD = config_json()[:10]


def test_hash_bucket_matches_the_committed_synthetic_lock(synthetic):
    _, lock = synthetic
    committed = load_lock(lock_path("dsv41-flash-synthetic"))
    assert [e.name for e in committed.files] == model_names()
    assert sorted((e.name, e.size, e.sha256) for e in lock.files) == sorted(
        (e.name, e.size, e.sha256) for e in committed.files
    )
    big = sorted(lock.files, key=lambda e: -e.size)
    assert {big[0].name, big[1].name} == {BIG, "model-00048-of-00048.safetensors"}
    assert big[1].size > 10 * big[2].size


def test_fetch_and_stage_give_hard_links_with_locked_content(s3, synthetic, blobs):
    _, lock = synthetic
    report = fetch(s3, lock, blobs)
    assert sorted(report.fetched) == sorted(model_names())
    assert report.downloaded == lock.size
    folder = blobs.models / cache_key(lock.source)
    stage(folder, stage_plan(lock), blobs)
    for entry in lock.files:
        staged = folder / entry.name
        assert not staged.is_symlink()
        assert staged.stat().st_ino == blobs.blob(entry.sha256).stat().st_ino
        assert hashlib.sha256(staged.read_bytes()).hexdigest() == entry.sha256
    assert is_staged(folder, stage_plan(lock), blobs)


def test_noop_rerun_reads_no_model_bytes(s3, synthetic, blobs):
    _, lock = synthetic
    fetch(s3, lock, blobs)
    folder = blobs.models / cache_key(lock.source)
    stage(folder, stage_plan(lock), blobs)
    again = BlobStore(blobs.root, StatCache(blobs.statcache.db_path))  # as a new process
    before = read_chars()
    assert again.missing(lock) == []
    assert is_staged(folder, stage_plan(lock), again)
    assert fetch(s3, lock, again).downloaded == 0
    assert read_chars() - before < 1 << 20  # sqlite pages only; the model is ~70 MiB


def test_flipped_byte_in_bucket_is_detected_named_and_not_stored(s3, synthetic, blobs):
    with fresh_source(s3, "flipped") as bad_source:
        flipped_byte_is_detected(s3, synthetic, blobs, bad_source)


def flipped_byte_is_detected(s3, synthetic, blobs, bad_source: str) -> None:
    """A copy of the model under bad_source with one byte of BIG flipped fails its fetch."""
    source, lock = synthetic
    url, bad_url = S3Url.parse(source), S3Url.parse(bad_source)
    for entry in lock.files:
        s3.copy_object(
            Bucket=bad_url.bucket,
            Key=bad_url.key(entry.name),
            CopySource={"Bucket": url.bucket, "Key": url.key(entry.name)},
        )
    data = bytearray(s3.get_object(Bucket=url.bucket, Key=url.key(BIG))["Body"].read())
    data[len(data) // 2] ^= 0x01
    s3.put_object(Bucket=bad_url.bucket, Key=bad_url.key(BIG), Body=bytes(data))
    bad_lock = Lock(model=lock.model, source=bad_source, files=lock.files)
    expected = bad_lock.entry(BIG).sha256
    actual = hashlib.sha256(data).hexdigest()

    with pytest.raises(FetchError) as err:
        fetch(s3, bad_lock, blobs)
    assert str(err.value) == (
        f"{BIG}: sha256 mismatch: expected {expected}, got {actual} (not stored)"
    )
    assert not blobs.blob(expected).exists()
    assert not blobs.partial_file(expected).exists()
    assert [e.name for e in blobs.missing(bad_lock)] == [BIG]  # the other 53 completed
    with pytest.raises(PipelineError, match=BIG):
        stage(blobs.models / "x", stage_plan(bad_lock), blobs)


KILLABLE_FETCH = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from pipelines.engine.statcache import StatCache
    from pipelines.stages.weights.blobs import BlobStore
    from pipelines.stages.weights.fetch import fetch_lock
    from pipelines.stages.weights.options import FetchOptions
    from pipelines.stages.weights.s3 import s3_client
    from pipelines.core.modellock import load_lock
    lock = load_lock(Path(sys.argv[1]))
    blobs = BlobStore(sys.argv[2], StatCache(sys.argv[3]))
    rate = float(sys.argv[4]) if len(sys.argv) > 4 else 4e6
    options = FetchOptions(part_size=1 << 20, workers=2, ahead=2, max_rate=rate)
    fetch_lock(s3_client(), lock, blobs, options)
    """
)


def test_a_write_the_disk_refuses_fails_that_file_in_one_line_and_stores_the_rest(
    s3, synthetic, blobs
):
    _, lock = synthetic
    big = next(e for e in lock.files if e.name == BIG)
    part = blobs.partial_file(big.sha256)
    part.parent.mkdir(parents=True, exist_ok=True)
    part.symlink_to("/dev/full")  # every write to it fails as on a full disk
    with pytest.raises(FetchError) as failed:
        fetch(s3, lock, blobs)
    assert str(failed.value) == f"{BIG}: writing {part}: No space left on device"
    assert blobs.missing(lock) == [big]


def test_fetch_killed_mid_file_resumes_without_downloading_what_it_has(
    s3, synthetic, blobs, tmp_path, stack_env
):
    _, lock = synthetic
    one = Lock(model=lock.model, source=lock.source, files=[lock.entry(BIG)])
    lock_file = tmp_path / "one.lock.yaml"
    lock_file.write_text(json.dumps(as_data(one)))
    entry = one.files[0]
    part = blobs.partial_file(entry.sha256)
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLABLE_FETCH, lock_file, blobs.root, blobs.statcache.db_path],
        env={**os.environ, **stack_env},
        cwd=REPO,
    )
    deadline = time.monotonic() + 60
    while not part.exists() or part.stat().st_size < 6 << 20:
        assert proc.poll() is None, "the fetch ended before it could be killed"
        assert time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    have = part.stat().st_size
    remaining = entry.size - have
    assert 0 < remaining < entry.size
    assert not blobs.blob(entry.sha256).exists()

    report = fetch(s3, one, blobs, part_size=1 << 20)
    assert report.downloaded == remaining  # nothing it had on disk came over the network again
    assert report.read_back == have
    assert blobs.is_intact(entry.sha256, entry.size)
    assert not part.exists()


def test_objects_missing_from_the_bucket_fail_one_line_each_and_the_rest_is_fetched(
    s3, synthetic, blobs
):
    source, lock = synthetic
    small = [e for e in lock.files if e.name.startswith("model-0000")][:3]
    gone = [replace(e, name=f"gone-{i}.safetensors") for i, e in enumerate(small)]
    mixed = Lock(model=lock.model, source=source, files=[*gone, lock.entry("config.json")])
    # One range buffer: a failed range must hand its buffer back for the next file to fetch.
    with pytest.raises(FetchError) as err:
        fetch(s3, mixed, blobs, files_at_once=1, ahead=1, workers=1, part_size=1 << 20)
    url = S3Url.parse(source)
    assert sorted(str(err.value).split("\n")) == [
        f"{url.key(e.name)}: S3 said NoSuchKey" for e in gone
    ]
    assert blobs.missing(mixed) == gone


def test_a_local_file_error_fails_its_file_in_one_line_beside_the_others_failures(
    s3, synthetic, blobs
):
    source, lock = synthetic
    small = [e for e in lock.files if e.name.startswith("model-0000")][:3]
    blocked, gone = small[0], replace(small[1], name="gone.safetensors")
    part = blobs.partial_file(blocked.sha256)
    part.mkdir()  # opening it fails with IsADirectoryError, as EACCES or EIO would
    mixed = Lock(model=lock.model, source=source, files=[blocked, gone, small[2]])
    with pytest.raises(FetchError) as err:
        fetch(s3, mixed, blobs, files_at_once=1)
    assert sorted(str(err.value).split("\n")) == sorted(
        [
            f"{blocked.name}: [Errno 21] Is a directory: '{part}'",
            f"{S3Url.parse(source).key(gone.name)}: S3 said NoSuchKey",
        ]
    )
    assert blobs.missing(mixed) == [blocked, gone]


def test_a_missing_object_of_many_ranges_fails_in_one_line(s3, synthetic, blobs):
    source, lock = synthetic
    gone = replace(lock.entry(BIG), name="gone.safetensors")
    missing = Lock(model=lock.model, source=source, files=[gone])
    # Several ranges in flight when the first fails: theirs are dropped, its error is the line.
    with pytest.raises(FetchError) as err:
        fetch(s3, missing, blobs, part_size=1 << 20, ahead=4, workers=4)
    assert str(err.value) == f"{S3Url.parse(source).key(gone.name)}: S3 said NoSuchKey"


class RecordingProgress:
    """A progress display that keeps what it was told (label, totals, bytes per file)."""

    made: list[RecordingProgress] = []

    def __init__(self, label: str, total: int, big_files: dict[str, int]):
        self.label, self.total, self.big_files = label, total, big_files
        self.bytes: dict[str, int] = {}
        self.closed = False
        RecordingProgress.made.append(self)

    def advance(self, name: str, n: int) -> None:
        self.bytes[name] = self.bytes.get(name, 0) + n

    def close(self) -> None:
        self.closed = True


def test_a_fetch_shows_progress_of_what_it_lacks_and_reports_what_it_reused(s3, synthetic, blobs):
    _, lock = synthetic
    have = [e for e in lock.files if e.name != BIG and e.size < 1 << 20]
    fetch(s3, Lock(model=lock.model, source=lock.source, files=have), blobs)
    missing = [e for e in lock.files if e not in have]
    RecordingProgress.made.clear()
    report = fetch_lock(s3, lock, blobs, FetchOptions(), progress_factory=RecordingProgress)
    [progress] = RecordingProgress.made
    assert progress.label == f"fetch {lock.model}" and progress.closed
    assert progress.total == sum(e.size for e in missing) == report.downloaded
    biggest = sorted(missing, key=lambda e: e.size, reverse=True)[:2]
    assert progress.big_files == {e.name: e.size for e in biggest}
    assert progress.bytes == {e.name: e.size for e in missing}
    assert sorted(report.fetched) == sorted(e.name for e in missing)
    assert sorted(report.reused) == sorted(e.name for e in have)

    again = fetch_lock(s3, lock, blobs, FetchOptions(), progress_factory=RecordingProgress)
    assert len(RecordingProgress.made) == 1  # nothing lacking: no progress display at all
    assert again.fetched == [] and again.downloaded == 0
    assert again.reused == [e.name for e in lock.files]


def test_a_fetch_capped_at_a_rate_takes_at_least_size_over_rate(s3, synthetic, blobs):
    _, lock = synthetic
    shards = Lock(
        model=lock.model,
        source=lock.source,
        files=[e for e in lock.files if e.name.startswith("model-0000")][:4],
    )
    size = sum(e.size for e in shards.files)
    rate = 4e6
    started = time.monotonic()
    fetch(s3, shards, blobs, part_size=1 << 20, max_rate=rate)
    took = time.monotonic() - started
    # Each range's bytes are paid for after they arrive: all but the last MiB wait their turn.
    assert took >= 0.9 * (size - (1 << 20)) / rate, took
    assert blobs.missing(shards) == []


def test_blobs_are_read_only_files_named_by_sha256_under_blobs_sha256(s3, synthetic, blobs):
    _, lock = synthetic
    entry = lock.entry("config.json")
    fetch(s3, Lock(model=lock.model, source=lock.source, files=[entry]), blobs)
    blob = blobs.root / "blobs" / "sha256" / entry.sha256
    assert blob.is_file() and blob.stat().st_mode & 0o777 == 0o444
    assert blobs.partial_file("ab") == blobs.root / "partial" / "ab.part"
    assert blobs.models == blobs.root / "models" and blobs.models.is_dir()

    data = b'{"patched": true}'
    sha = blobs.add_bytes(data)
    added = blobs.root / "blobs" / "sha256" / sha
    assert sha == hashlib.sha256(data).hexdigest()
    assert added.read_bytes() == data and added.stat().st_mode & 0o777 == 0o444
    inode = added.stat().st_ino
    assert blobs.add_bytes(data) == sha and added.stat().st_ino == inode  # not written again
    assert blobs.is_intact(sha, len(data))


def test_blobs_are_checked_by_size_and_hashed_when_the_stat_cache_never_saw_them(
    s3, synthetic, blobs, tmp_path
):
    _, lock = synthetic
    small = Lock(
        model=lock.model,
        source=lock.source,
        files=[e for e in lock.files if e.name.startswith("model-0000")][:3],
    )
    fetch(s3, small, blobs)
    # The same blobs seen with a new stat cache (copied from another node): hashed, and kept.
    fresh = BlobStore(blobs.root, StatCache(tmp_path / "new-statcache.sqlite3"))
    before = read_chars()
    assert fresh.missing(small) == []
    assert read_chars() - before >= sum(e.size for e in small.files)
    cut = small.files[0]
    os.truncate(blobs.blob(cut.sha256), cut.size - 1)
    assert fresh.missing(small) == [cut]


def test_plain_s3_bodies_are_read_straight_from_the_socket(s3, synthetic, monkeypatch):
    """A range is read from http.client straight into its buffer (urllib3's and botocore's
    readers read into a temporary and copy it); a body with a content-encoding goes through
    botocore."""
    source, _ = synthetic
    url = S3Url.parse(source)
    plain = s3.get_object(Bucket=url.bucket, Key=url.key("config.json"), Range="bytes=0-9")

    def copying_read(*args, **kwargs):
        raise AssertionError("the range went through urllib3's copying read")

    monkeypatch.setattr(urllib3.response.HTTPResponse, "read", copying_read)
    view = memoryview(bytearray(10))
    fill(plain, view, "config.json", None, lambda n: None)
    assert bytes(view) == CONFIG_HEAD
    monkeypatch.undo()
    with fresh_source(s3, "encoded") as encoded:
        target = S3Url.parse(encoded)
        s3.put_object(
            Bucket=target.bucket,
            Key=target.key("config.json"),
            Body=gzip.compress(b"{}"),
            ContentEncoding="gzip",
        )
        zipped = s3.get_object(Bucket=target.bucket, Key=target.key("config.json"))
        try:
            assert direct_readinto(zipped) == zipped["Body"].readinto
        finally:
            zipped["Body"].close()


def test_a_fetch_takes_the_biggest_files_first(s3, synthetic, blobs):
    _, lock = synthetic
    small = Lock(
        model=lock.model, source=lock.source, files=[e for e in lock.files if e.size < 1 << 20]
    )
    RecordingProgress.made.clear()
    fetch_lock(s3, small, blobs, FetchOptions(files_at_once=1), progress_factory=RecordingProgress)
    [progress] = RecordingProgress.made
    biggest_first = sorted(small.files, key=lambda e: e.size, reverse=True)
    assert list(progress.bytes) == [e.name for e in biggest_first]
    assert biggest_first[0].size > biggest_first[-1].size


def test_a_file_another_process_stored_meanwhile_is_reported_reused(s3, synthetic, blobs):
    source, lock = synthetic
    config, other = lock.entry("config.json"), lock.entry("model-00001-of-00048.safetensors")
    url = S3Url.parse(source)
    data = s3.get_object(Bucket=url.bucket, Key=url.key(config.name))["Body"].read()

    def stored_meanwhile(label: str, total: int, big_files: dict[str, int]) -> RecordingProgress:
        # Another process finishes config.json after this fetch found it missing.
        assert blobs.add_bytes(data) == config.sha256
        return RecordingProgress(label, total, big_files)

    two = Lock(model=lock.model, source=source, files=[config, other])
    RecordingProgress.made.clear()
    report = fetch_lock(s3, two, blobs, FetchOptions(), progress_factory=stored_meanwhile)
    [progress] = RecordingProgress.made
    assert progress.bytes == {config.name: config.size, other.name: other.size}  # both done
    assert report.reused == [config.name]
    assert report.fetched == [other.name]
    assert report.downloaded == other.size
    assert blobs.missing(two) == []


class InterruptingProgress(NoProgress):
    """Presses Ctrl-C (SIGINT to the main thread) when the first bytes arrive."""

    def __init__(self, *args):
        self.sent = False

    def advance(self, name: str, n: int) -> None:
        if not self.sent:
            self.sent = True
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)


def test_ctrl_c_during_a_fetch_raises_keyboardinterrupt_and_the_next_fetch_completes(
    s3, synthetic, blobs
):
    _, lock = synthetic
    entry = lock.entry(BIG)
    one = Lock(model=lock.model, source=lock.source, files=[entry])
    options = FetchOptions(part_size=1 << 20, workers=1, ahead=1)
    # Python's own Ctrl-C handling, whatever runs the tests (a mutation runner has its own).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            fetch_lock(s3, one, blobs, options, progress_factory=InterruptingProgress)
    finally:
        signal.signal(signal.SIGINT, previous)
    have = blobs.partial_file(entry.sha256).stat().st_size
    assert have > 0  # the ranges verified before Ctrl-C are kept to resume from
    report = fetch(s3, one, blobs, part_size=1 << 20)
    assert blobs.is_intact(entry.sha256, entry.size)
    assert report.read_back == have
    assert report.downloaded == entry.size - have  # what it had came not again


def test_ctrl_c_while_a_large_prefix_is_read_back_stops_without_reading_it_all(
    s3, synthetic, blobs
):
    source, lock = synthetic
    entry = replace(lock.entry(BIG), name="big.safetensors", size=64 << 30, sha256="1" * 64)
    part = blobs.partial_file(entry.sha256)
    with open(part, "wb") as f:
        # A sparse 64 GiB prefix: half a minute to hash whole, where a machine loaded enough to
        # take seconds to deliver Ctrl-C to the main thread still stops it in the first quarter
        # (8 GiB was read back whole once, a parallel lane beside the main job's stack).
        f.truncate(entry.size - (1 << 20))
    fetcher = fetch_module.Fetcher(
        S3Source(s3, S3Url.parse(source)),
        blobs,
        FetchOptions(part_size=1 << 20, files_at_once=1),
        InterruptingProgress(),
    )
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            fetcher.fetch([entry])  # Ctrl-C at the first megabyte read back
    finally:
        signal.signal(signal.SIGINT, previous)
    assert fetcher.report.read_back < entry.size // 4
    assert part.stat().st_size == entry.size - (1 << 20)  # kept, to resume from


def test_the_ring_member_as_a_containers_first_process_stops_on_sigterm_as_on_ctrl_c(
    synthetic, stack_env, tmp_path
):
    # PID 1 of a PID namespace, as in its container, where `docker stop` sends SIGTERM: the
    # kernel drops a signal PID 1 has no handler for, and the engine would SIGKILL it later.
    _, lock = synthetic
    entries = [(e.name, e.locked_size, e.locked_sha256) for e in lock.files]
    # The second member never starts: the first fetches its share, then waits for the rest.
    nodes = [RingNode("spark-a", "127.0.0.1", {}), RingNode("spark-b", "127.0.0.2", {})]
    plan = plan_ring(lock.model, lock.source, "0" * 64, entries, nodes, spare_ports())
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(plan_json(plan))
    # Its blob server's workers run as nobody and must enter the store (pytest's tmp is 0700).
    served = Path(tempfile.mkdtemp(dir="/var/tmp"))
    served.chmod(0o711)
    root = served / "weights"
    argv = [sys.executable, "-m", "pipelines.stages.weights.ring", "--plan", str(plan_file),
            "--rank", "0", "--root", str(root), "--interval", "1"]  # fmt: skip
    env = {**os.environ, **stack_env}
    try:
        with first_process(
            argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        ) as member:
            assert member.stdout is not None
            said = [member.stdout.readline()]
            assert "serving on" in said[0], said
            # Ignored, it would wait the whole peer wait (30 minutes).
            status = stop(member, "the ring member", 60)
            said += member.stdout.readlines()
        assert status == INTERRUPTED, said
        assert not list((root / "blobs" / "sha256").glob(".*")), "a temp file left behind"
    finally:
        shutil.rmtree(served)


def test_a_partial_file_that_is_already_whole_is_stored_without_downloading(s3, synthetic, blobs):
    """A fetch killed after its last byte, before the rename: the next one only hashes it."""
    source, lock = synthetic
    entry = lock.entry("config.json")
    url = S3Url.parse(source)
    data = s3.get_object(Bucket=url.bucket, Key=url.key(entry.name))["Body"].read()
    blobs.partial_file(entry.sha256).write_bytes(data)
    one = Lock(model=lock.model, source=source, files=[entry])
    RecordingProgress.made.clear()
    report = fetch_lock(s3, one, blobs, FetchOptions(), progress_factory=RecordingProgress)
    assert (report.fetched, report.downloaded, report.read_back) == ([entry.name], 0, entry.size)
    assert RecordingProgress.made[0].bytes == {entry.name: entry.size}  # read back, shown
    assert blobs.blob(entry.sha256).read_bytes() == data


def test_a_partial_file_longer_than_the_file_is_fetched_again_from_the_start(s3, synthetic, blobs):
    source, lock = synthetic
    entry = lock.entry("model-00001-of-00048.safetensors")
    blobs.partial_file(entry.sha256).write_bytes(b"x" * (entry.size + 10))
    one = Lock(model=lock.model, source=source, files=[entry])
    report = fetch(s3, one, blobs)
    assert (report.fetched, report.downloaded, report.read_back) == ([entry.name], entry.size, 0)
    assert blobs.is_intact(entry.sha256, entry.size)


class BothFilesAtOnce(NoProgress):
    """A progress display that lets a file go on only once the other one has bytes too."""

    def __init__(self, *args):
        self.seen: set[str] = set()
        self.both = threading.Event()
        self.gave_up = False

    def advance(self, name: str, n: int) -> None:
        self.seen.add(name)
        if len(self.seen) == 2:
            self.both.set()
        if not self.gave_up and not self.both.wait(timeout=30):
            self.gave_up = True  # one file waited for the other to finish


def test_files_are_fetched_at_the_same_time(s3, synthetic, blobs):
    source, lock = synthetic
    two = Lock(model=lock.model, source=source, files=[lock.entry(BIG), lock.entry("config.json")])
    made = []

    def progress(*args) -> BothFilesAtOnce:
        made.append(BothFilesAtOnce())
        return made[0]

    options = FetchOptions(files_at_once=2, workers=2, ahead=1, part_size=1 << 20)
    report = fetch_lock(s3, two, blobs, options, progress_factory=progress)
    assert sorted(report.fetched) == sorted(e.name for e in two.files)
    assert not made[0].gave_up


def test_a_files_last_ranges_are_quarter_parts_and_the_rest_whole_parts(
    s3, synthetic, blobs, monkeypatch
):
    # Its hash goes in order: the ranges that arrive last are hashed after the link went quiet.
    source, lock = synthetic
    entry = lock.entry(BIG)
    asked = []
    read = sources_module.read_range

    def recording(client, url, name, start, view, *args):
        asked.append((start, start + len(view)))
        read(client, url, name, start, view, *args)

    monkeypatch.setattr(sources_module, "read_range", recording)
    part = 1 << 20
    one = Lock(model=lock.model, source=source, files=[entry])
    fetch_lock(s3, one, blobs, FetchOptions(part_size=part))
    assert sorted(asked) == plan_ranges(entry.size, part, tapered=True)
    sizes = [end - start for start, end in sorted(asked)]
    assert entry.size > 4 * part and sum(sizes) == entry.size
    tail = sizes.index(part // 4)
    assert set(sizes[:tail]) == {part} and 2 * part <= sum(sizes[tail:]) < 3 * part
    assert set(sizes[tail:-1]) == {part // 4}
    assert plan_ranges(4 * part, part, tapered=True) == plan_ranges(4 * part, part)


def test_the_range_buffers_are_unmapped_off_the_fetchs_path(s3, synthetic, blobs, monkeypatch):
    # Unmapping 1 GiB of them took 60 ms after the link's last byte (16 cores, 10 Gbit/s): a
    # fetch returns, its files published, while a thread of its own lets go of them.
    source, lock = synthetic
    unmap, returned, done, unmapped = fetch_module.unmap_buffers, threading.Event(), [], []
    finished = threading.Event()

    def held_unmap(buffers):
        returned.wait(timeout=10)  # a fetch that waited for the unmap waits this long
        unmapped.append(buffers.qsize())
        unmap(buffers)
        unmapped.append(buffers.qsize())
        done.append(threading.current_thread().name)
        finished.set()

    monkeypatch.setattr(fetch_module, "unmap_buffers", held_unmap)
    options = FetchOptions(part_size=1 << 20)
    report = fetch_lock(s3, lock, blobs, options, progress_factory=NoProgress)
    assert len(report.fetched) == len(lock.files) and not done
    assert all(blobs.blob(e.sha256).exists() for e in lock.files)
    returned.set()
    assert finished.wait(timeout=30)
    assert done == ["unmap"] and unmapped == [options.files_at_once * options.ahead, 0]


PROGRESS = textwrap.dedent(
    """
    from pipelines.core.progress import Progress
    p = Progress("fetch m", 100 << 20, {"big": 100 << 20}, interval=0.1)
    for i in range(10):
        p.advance("big", 10 << 20)
    p.close()
    """
)


def test_the_live_progress_goes_to_the_terminal_it_checked_when_stdout_is_a_log(tmp_path):
    """`doit build | tee log`: stderr is the terminal, stdout a pipe or file."""
    terminal, side = pty.openpty()
    log = tmp_path / "log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", PROGRESS],
            stdout=out,
            stderr=side,
            cwd=REPO,
            env={**os.environ, "TERM": "xterm"},
        )
        os.close(side)
        shown = b""
        with contextlib.suppress(OSError):  # EIO once the child has closed its side
            while chunk := os.read(terminal, 65536):
                shown += chunk
        proc.wait()
    os.close(terminal)
    assert log.read_bytes() == b""
    assert b"fetch m" in shown and b"100.0/100.0 MiB" in shown


@pytest.mark.parametrize("cpus", [1, 2])
def test_a_fetchs_ranges_and_files_follow_the_cpus_it_may_run_on(cpus):
    # Sixteen ranges of eight files cost a small runner CPU and fill its link no sooner
    # (options.py): the defaults are four ranges and two files per CPU of the process's
    # affinity (a cpuset's, a runner's share), up to 16 and 8.
    if len(os.sched_getaffinity(0)) < cpus:
        pytest.fail(f"this machine runs the tests on fewer than {cpus} CPUs")
    probe = (
        "import os; from pipelines.stages.weights.options import FetchOptions;"
        f" os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:{cpus}]);"
        " o = FetchOptions(); print(o.workers, o.files_at_once)"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.stdout.split() == [str(4 * cpus), str(2 * cpus)], done.stderr
