"""Benchmark: the no-op check of a full-size lock (54 files, 460 GB) must cost only stats.

Run: .venv/bin/python tests/perf/noop.py

Builds a blob store of 54 sparse blobs with the model's real sizes, primes the stat cache the
way a fetch does (it records the hash it streamed; here the digests are stand-ins, since the
check never reads a byte either way), stages the model folder, then times what `doit build`
asks on a no-op run: every blob intact and the folder exactly the plan, from a fresh handle.
Target: under 0.3 s wall, no file bytes read.

Then the whole process, as a person waits for it (needs `scripts/stack up` and one finished
`doit build profile=local`): median of 5 wall times of `doit list` (target 0.35 s) and of a
no-op `doit build profile=local` (target 0.6 s), beside `python -c "import doit"`.
"""

from __future__ import annotations

import hashlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from keying import model_sizes, read_chars  # noqa: E402

from pipelines.core.modellock import Lock, LockEntry, cache_key  # noqa: E402
from pipelines.engine.statcache import StatCache, stat_key  # noqa: E402
from pipelines.stages.weights.blobs import BlobStore  # noqa: E402
from pipelines.stages.weights.stage import is_staged, stage, stage_plan  # noqa: E402


def full_size_store(root: Path) -> tuple[BlobStore, Lock, Path]:
    """A primed blob store, its lock and the staged folder, for the 460 GB model shape."""
    blobs = BlobStore(root / "weights", StatCache(root / "statcache.sqlite3"))
    files, primed = [], []
    for name, size in model_sizes().items():
        sha = hashlib.sha256(name.encode()).hexdigest()
        path = blobs.blob(sha)
        with open(path, "wb") as f:
            f.truncate(size)
        files.append(LockEntry(name=name, size=size, sha256=sha))
        primed.append((path.absolute(), stat_key(os.stat(path)), sha))
    blobs.statcache.record(primed)
    lock = Lock(model="full-size", source="s3://models/full-size/model", files=files)
    folder = blobs.models / cache_key(lock.source)
    stage(folder, stage_plan(lock), blobs)
    return blobs, lock, folder


def noop_check(blobs: BlobStore, lock: Lock, folder: Path) -> bool:
    """What a no-op `doit build` asks of the weights: all intact, folder as planned."""
    fresh = BlobStore(blobs.root, StatCache(blobs.statcache.db_path))
    return not fresh.missing(lock) and is_staged(folder, stage_plan(lock), fresh)


REPO = Path(__file__).resolve().parents[2]


def process_seconds(argv: list[str], runs: int = 5) -> float:
    """Median wall time of a whole process, start-up included (the first run warms caches)."""
    subprocess.run(argv, cwd=REPO, capture_output=True, check=True)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(argv, cwd=REPO, capture_output=True, check=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def report_processes() -> None:
    """Whole-process wall times of the commands a no-op run is made of."""
    python = sys.executable
    rows = [
        ("python -c 'import doit'", [python, "-c", "import doit"], None),
        ("doit list", [python, "-m", "doit", "list"], 0.35),
        ("doit build profile=local (no-op)", [python, "-m", "doit", "build", "profile=local"], 0.6),
    ]
    print("whole process, median of 5:")
    for label, argv, target in rows:
        took = process_seconds(argv)
        goal = f" (target {target} s)" if target else ""
        print(f"  {label}: {took:.2f} s{goal}")


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="noop-") as tmp:
        blobs, lock, folder = full_size_store(Path(tmp))
        times, reads = [], []
        for _ in range(9):
            before, start = read_chars(), time.perf_counter()
            assert noop_check(blobs, lock, folder)
            times.append(time.perf_counter() - start)
            reads.append(read_chars() - before)
        print(f"no-op check of {len(lock.files)} files, {lock.size / 1e9:.0f} GB:")
        print(
            f"  median {statistics.median(times) * 1000:.1f} ms, max {max(times) * 1000:.1f} ms"
            f" (target < 300 ms); bytes read via read(): max {max(reads):,}"
        )
    report_processes()


if __name__ == "__main__":
    main()
