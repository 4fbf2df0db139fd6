"""Benchmark: keying the model's 54 files, warm (stat cache) and cold (hashing rate vs peers).

Run: .venv/bin/python tests/perf/keying.py [--dir DIR] [--cold-gib 3]

Warm: 54 sparse files with the real model's sizes (460 GB in all), hashed once to fill the
stat cache (honestly, which takes minutes), then keyed again as a fresh process would be.
Target: under 0.2 s wall, no file bytes read.
Cold: a few GiB of real random data in the page cache, hashed by this project's parallel
hasher, by coreutils `sha256sum`, and by one plain hashlib stream, alternating, medians.
Target: at least 1.8x the single stream on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from plot import bar_chart  # noqa: E402

from pipelines.core.files import hash_file  # noqa: E402
from pipelines.engine.statcache import StatCache  # noqa: E402
from pipelines.engine.steps import Engine, Step  # noqa: E402
from pipelines.engine.store import Store  # noqa: E402

GB = 10**9
SMALL = {
    "config.json": 6_000,
    "quantization_config.json": 2_000,
    "model.safetensors.index.json": 3_000_000,
    "tokenizer.json": 7_800_000,
    "tokenizer_config.json": 40_000,
    "MD5SUMS.body": 4_000,
}


def model_sizes() -> dict[str, int]:
    """The 54 files at the sizes FACTS.md gives: 460 GB, shards 47 and 48 at 101 GB each."""
    rest = 460 * GB - 2 * 101 * GB - sum(SMALL.values())
    sizes = dict(SMALL)
    for n in range(1, 47):
        sizes[f"model-{n:05d}-of-00048.safetensors"] = rest // 46 + (1 if n <= rest % 46 else 0)
    sizes["model-00047-of-00048.safetensors"] = 101 * GB
    sizes["model-00048-of-00048.safetensors"] = 101 * GB
    return sizes


def read_chars() -> int:
    """Bytes read through read() by this process so far."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise RuntimeError("no rchar in /proc/self/io")


def bench_warm(folder: Path) -> None:
    """Key a 54-file, 460 GB sparse model with a warm stat cache."""
    model = folder / "model"
    model.mkdir()
    sizes = model_sizes()
    for name, size in sizes.items():
        with open(model / name, "wb") as f:
            f.truncate(size)
    print(f"warm: {len(sizes)} sparse files, {sum(sizes.values()) / GB:.1f} GB")
    step = Step(
        name="weights",
        recipe="bench",
        version=1,
        doc="",
        action=lambda run: None,
        inputs={name: model / name for name in sizes},
    )
    start = time.monotonic()
    Engine(Store(folder / "store")).key(step)
    print(f"  filling the stat cache (hashing all of it once): {time.monotonic() - start:.1f} s")
    times, reads = [], []
    for _ in range(7):
        before, start = read_chars(), time.perf_counter()
        Engine(Store(folder / "store")).key(step)  # new engine and cache handle: no memo
        times.append(time.perf_counter() - start)
        reads.append(read_chars() - before)
    print(
        f"  warm keying: median {statistics.median(times) * 1000:.1f} ms, "
        f"max {max(times) * 1000:.1f} ms (target < 200 ms); "
        f"bytes read via read(): max {max(reads):,} (sqlite only, no model bytes)"
    )


def bench_cold(folder: Path, gib: float) -> None:
    """Hash real data: this project's parallel hasher vs sha256sum vs one hashlib stream."""
    data = folder / "cold"
    data.mkdir()
    total = int(gib * (1 << 30))
    # Shape of the model: two big files and a few smaller ones.
    parts = [total * 3 // 10, total * 3 // 10] + [total * 4 // 10 // 8] * 8
    files = []
    for i, size in enumerate(parts):
        path = data / f"part-{i:02d}.bin"
        with open(path, "wb") as f:
            left = size
            while left:
                n = min(left, 64 << 20)
                f.write(os.urandom(n))
                left -= n
        files.append(path)
    size = sum(parts)
    print(f"cold: {len(files)} files, {size / (1 << 30):.2f} GiB of random data (page cache)")

    def ours() -> None:
        cache = folder / "cold-cache.sqlite3"
        cache.unlink(missing_ok=True)
        StatCache(cache).digest_files(files)

    def single() -> None:
        for path in files:
            hash_file(path)

    def sha256sum() -> None:
        subprocess.run(["sha256sum", *map(str, files)], check=True, stdout=subprocess.DEVNULL)

    runners = {
        "sparkforge (parallel)": ours,
        "hashlib single stream": single,
        "sha256sum": sha256sum,
    }
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(3):
        for name, run in runners.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(t) for name, t in times.items()}
    for name, t in medians.items():
        print(f"  {name:24s} median {t:6.2f} s  {size / t / GB:5.2f} GB/s")
    ratio = medians["hashlib single stream"] / medians["sparkforge (parallel)"]
    vs_coreutils = medians["sha256sum"] / medians["sparkforge (parallel)"]
    print(f"  ratio vs single stream: {ratio:.2f}x (target >= 1.8x on {os.cpu_count()} cores)")
    print(f"  ratio vs sha256sum: {vs_coreutils:.2f}x")
    rates = {name: size / t / GB for name, t in medians.items()}
    title = f"Hashing {size / (1 << 30):.2f} GiB in page cache ({os.cpu_count()} cores)"
    print(f"plot: {bar_chart('keying', title, 'GB/s (higher is better)', rates)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=None, help="scratch folder (default: tmp)")
    parser.add_argument("--cold-gib", type=float, default=3.0)
    parser.add_argument("--skip-warm", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="keying-") as tmp:
        if not args.skip_warm:
            bench_warm(Path(tmp))
        bench_cold(Path(tmp), args.cold_gib)


if __name__ == "__main__":
    main()
