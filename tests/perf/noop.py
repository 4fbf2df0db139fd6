"""Benchmark: the no-op check of a full-size lock (54 files, 460 GB) must cost only stats.

Run: .venv/bin/python tests/perf/noop.py

Builds a blob store of 54 sparse blobs with the model's real sizes, primes the stat cache the
way a fetch does (it records the hash it streamed; here the digests are stand-ins, since the
check never reads a byte either way), stages the model folder, then times what `doit build`
asks on a no-op run: every blob intact and the folder exactly the plan, from a fresh handle.
Target: under 0.3 s wall, no file bytes read.

Then the whole process, as a person waits for it (needs `scripts/stack up`): medians of 9 wall
times of `doit list` (target 0.25 s) and of a no-op `doit build profile=local` (target 0.30 s),
beside `python -c "import doit"`, after one `doit build profile=local` that does the work. With
`--against COMMIT`, the same for that commit in the same run, its checkout a git worktree
beside this one (its own store, this checkout's stack), the runs of the two interleaved.
"""

from __future__ import annotations

import argparse
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
RUNS = 9


def one_run(argv: list[str], tree: Path) -> float:
    """Wall seconds of one whole process in a checkout (the stack is this checkout's)."""
    env = {**os.environ, "SPARKFORGE_STACK_DIR": str(REPO / ".stack")}
    start = time.perf_counter()
    done = subprocess.run(argv, cwd=tree, env=env, capture_output=True, text=True)
    took = time.perf_counter() - start
    if done.returncode != 0:
        said = (done.stderr.strip() or done.stdout.strip()).splitlines()[-1:] or ["no output"]
        command = " ".join([Path(argv[0]).name, *argv[1:]])
        raise SystemExit(f"noop: `{command}` in {tree} exited {done.returncode}: {said[0]}")
    return took


def report_processes(trees: dict[str, Path]) -> None:
    """Whole-process wall times of the commands a no-op run is made of, per checkout."""
    python = sys.executable
    rows = [
        ("python -c 'import doit'", [python, "-c", "import doit"], None),
        ("doit list", [python, "-m", "doit", "list"], 0.25),
        (
            "doit build profile=local (no-op)",
            [python, "-m", "doit", "build", "profile=local"],
            0.30,
        ),
    ]
    for tree in trees.values():
        one_run(rows[2][1], tree)  # the build itself, once: what follows is the no-op
    print(f"whole process, median of {RUNS} (runs of the checkouts interleaved):")
    for label, argv, target in rows:
        times: dict[str, list[float]] = {name: [] for name in trees}
        for _ in range(RUNS):
            for name, tree in trees.items():
                times[name].append(one_run(argv, tree))
        goal = f" (target {target} s)" if target else ""
        took = ", ".join(f"{name} {statistics.median(t):.3f} s" for name, t in times.items())
        print(f"  {label}: {took}{goal}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", help="a commit to time beside this checkout")
    args = parser.parse_args()
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
    if not args.against:
        report_processes({"this checkout": REPO})
        return
    with tempfile.TemporaryDirectory(prefix="noop-against-") as tmp:
        other = Path(tmp) / "tree"
        subprocess.run(
            ["git", "worktree", "add", "-q", "--detach", str(other), args.against],
            cwd=REPO,
            check=True,
        )
        # Its own modules compiled, as this checkout's are (by its tests and runs): where
        # PYTHONDONTWRITEBYTECODE is set, a fresh tree would compile them in every timed run.
        for tree in (REPO, other):
            subprocess.run(
                [sys.executable, "-m", "compileall", "-q", "dodo.py", "pipelines", "devstack"],
                cwd=tree,
                check=True,
            )
        try:
            report_processes({"this checkout": REPO, args.against[:10]: other})
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(other)], cwd=REPO)


if __name__ == "__main__":
    main()
