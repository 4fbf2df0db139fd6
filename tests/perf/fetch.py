"""Benchmark: fetching the synthetic model from SeaweedFS, ours vs s5cmd vs aws s3 cp.

Run: .venv/bin/python tests/perf/fetch.py [--runs 3] [--engram-mib 1200] [--shard-mib 40]
     [--link 2500mbit [--delay-ms 2]]   (as root: needs iproute2, network namespaces, htb)

Ours verifies sha256 of every file while it streams and writes into the blob store, durably;
s5cmd and `aws s3 cp --recursive` only copy. Runs alternate between the tools (so page cache
and server warm-up favour none), each into a fresh folder on the same disk; medians and the
ratios are printed (target ours/s5cmd <= 1.02 with --link, 1.0 without). Without --link the
S3 is the local stack's on loopback, and s5cmd + sync + a 2-thread hashlib verify of the same
files is timed too (what ours must beat on CPU). With --link a SeaweedFS of its own runs in a
network namespace behind a veth pair whose replies are shaped to that rate
(tests/perf/link.py), as a node's path to its storage server is; everything it makes is
removed when it ends. The link's bytes are sampled every 10 ms while each tool runs: when it
first ran full, how long the tool's tail left it below 90%, and a plot of each median run.
--dir /dev/shm/NAME puts the folders (destinations, the shaped S3's data) in memory: the link
and the CPU without the disk, whose speed on a shared VM moves more between minutes than the
tools differ.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from link import LinkError, shaped_s3  # noqa: E402
from plot import bar_chart, rate_chart  # noqa: E402

import devstack  # noqa: E402
from devstack.netns import bits_per_second  # noqa: E402
from pipelines.core.files import hash_file  # noqa: E402
from pipelines.core.progress import NoProgress  # noqa: E402
from pipelines.engine.statcache import StatCache  # noqa: E402
from pipelines.stages.weights.blobs import BlobStore  # noqa: E402
from pipelines.stages.weights.bucket import hash_bucket, list_objects  # noqa: E402
from pipelines.stages.weights.fetch import fetch_lock  # noqa: E402
from pipelines.stages.weights.options import FetchOptions  # noqa: E402
from pipelines.stages.weights.s3 import S3Url, s3_client  # noqa: E402
from pipelines.stages.weights.synthetic import SyntheticShape, model_names, upload_synthetic  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30
BIN = Path(sys.executable).parent


def ensure_model(client, source: str, shape: SyntheticShape):
    """Upload the synthetic model under source unless all 54 objects are there; lock it."""
    have = list_objects(client, S3Url.parse(source))
    if set(have) != set(model_names()):
        print(f"uploading synthetic model to {source} ...", flush=True)
        upload_synthetic(client, source, shape)
    print("locking (streaming every object through sha256) ...", flush=True)
    return hash_bucket(client, "perf", source, previous=None)


def run_ours(lock, dest: Path, options: FetchOptions) -> None:
    """This project's fetch, sha256 verified, into a fresh blob store."""
    blobs = BlobStore(dest, StatCache(dest / "statcache.sqlite3"))
    fetch_lock(s3_client(), lock, blobs, options, progress_factory=NoProgress)


def run_s5cmd(source: str, dest: Path, endpoint: str) -> None:
    """s5cmd cp of the whole prefix (no verification)."""
    subprocess.run(
        [str(BIN / "s5cmd"), "--endpoint-url", endpoint, "cp", f"{source}/*", f"{dest}/"],
        check=True,
        stdout=subprocess.DEVNULL,
    )


def run_s5cmd_synced(source: str, dest: Path, endpoint: str) -> None:
    """s5cmd cp, then sync: the same durability as ours (which fsyncs every file)."""
    run_s5cmd(source, dest, endpoint)
    os.sync()


def run_s5cmd_synced_verified(lock, source: str, dest: Path, endpoint: str) -> None:
    """s5cmd cp, sync, then sha256 of every file on 2 threads: the work ours does, in steps."""
    run_s5cmd_synced(source, dest, endpoint)
    with ThreadPoolExecutor(2) as pool:
        digests = list(pool.map(lambda e: hash_file(dest / e.name), lock.files))
    wrong = [e.name for e, digest in zip(lock.files, digests, strict=True) if digest != e.sha256]
    if wrong:
        raise SystemExit(f"s5cmd fetched {len(wrong)} files wrong: {wrong[:3]}")


def run_aws(source: str, dest: Path, endpoint: str) -> None:
    """aws s3 cp --recursive of the whole prefix (no verification)."""
    subprocess.run(
        [
            str(BIN / "aws"),
            "--endpoint-url",
            endpoint,
            "s3",
            "cp",
            "--recursive",
            "--quiet",
            source,
            str(dest),
        ],
        check=True,
    )


class LinkMeter:
    """Samples the bytes a link carried (its host end's rx_bytes) every 10 ms while a tool runs."""

    def __init__(self, device: str | None):
        self.path = Path(f"/sys/class/net/{device}/statistics/rx_bytes") if device else None
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> LinkMeter:
        if self.path is not None:
            self.samples = [(time.perf_counter(), int(self.path.read_text()))]
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self.samples.append((time.perf_counter(), int(self.path.read_text())))

    def _sample(self) -> None:
        while not self._stop.wait(0.01):
            self.samples.append((time.perf_counter(), int(self.path.read_text())))

    def rates(self, start: float, window: float = 0.1) -> list[tuple[float, float]]:
        """(seconds since start, bits per second over the window ending then)."""
        points, j = [], 0
        for t, n in self.samples:
            while self.samples[j][0] < t - window:
                j += 1
            t0, n0 = self.samples[j]
            if t - t0 >= window / 2:
                points.append((t - start, (n - n0) * 8 / (t - t0)))
        return points


def link_use(points: list[tuple[float, float]], took: float, rate: float) -> str:
    """When the link first ran full (>= 90% of rate) and how long its tail ran below that."""
    full = [t for t, bps in points if bps >= 0.9 * rate]
    if not full:
        return "never at 90% of the link"
    return f"link full from {full[0] - 0.1:.2f} s, tail below 90% {took - full[-1]:.2f} s"


def session_cpu(sid: int) -> float:
    """CPU seconds (user + system) of the live processes of session sid (the S3 server's)."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone since the listing
        # After the name: state, ppid, pgrp, session, ..., utime and stime (fields 14 and 15).
        if int(fields[3]) == sid:
            total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def own_cpu() -> float:
    """CPU seconds of this process and its waited-for children (the client under test)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def unwritten_bytes() -> int:
    """Bytes the kernel still holds for the disk (Dirty + Writeback in /proc/meminfo).

    Read when a tool returns: what its clock did not pay for. s5cmd and aws return with their
    files in the page cache; ours returns once every blob is durable.
    """
    fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    return sum(int(fields[key].split()[0]) * 1024 for key in ("Dirty", "Writeback"))


def sha256_rate() -> float:
    """Bytes per second that sha256 takes on one core here (the floor of what verifying costs)."""
    data = os.urandom(64 * MiB)
    digest = hashlib.sha256()
    start = time.perf_counter()
    for _ in range(8):
        digest.update(data)
    return 8 * len(data) / (time.perf_counter() - start)


def stack_server_session() -> int:
    """The session of the local stack's S3 server."""
    pid = next(s.pid for s in devstack.status() if s.name == "s3")
    return os.getsid(pid)


def print_cpu_floor(copy_cpu: list[tuple[float, float]], copy_s: float, hashing: float) -> None:
    """What a verifying client cannot beat where the cores, not the link, are the limit.

    Client and server share the cores: a copy that also verifies needs at least the copy's CPU
    (client and server) plus one sha256 pass. When the copy already keeps the cores busy, its
    time grows by that ratio at least.
    """
    client = statistics.median(c for c, _ in copy_cpu)
    served = statistics.median(s for _, s in copy_cpu)
    busy = (client + served) / (copy_s * (os.cpu_count() or 1))
    floor = (client + served + hashing) / (client + served)
    print(
        f"  s5cmd kept the cores {busy:.0%} busy; where they are the limit, a verifying client"
        f" is at least {floor:.2f} x s5cmd here (s5cmd's CPU {client + served:.1f} s"
        f" + sha256 {hashing:.1f} s)"
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--engram-mib", type=int, default=1200)
    parser.add_argument("--shard-mib", type=int, default=40)
    defaults = FetchOptions()
    parser.add_argument("--part-mib", type=float, default=defaults.part_size / MiB)
    parser.add_argument("--workers", type=int, default=defaults.workers)
    parser.add_argument("--files-at-once", type=int, default=defaults.files_at_once)
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--link", help="shape the path to S3 to this rate (2500mbit, 10gbit)")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay (netem)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    with contextlib.ExitStack() as stack:
        if args.link:
            # Keys of this run only, for a server of this run only.
            credentials = {
                "AWS_ACCESS_KEY_ID": "fetch-bench",
                "AWS_SECRET_ACCESS_KEY": secrets.token_hex(16),
            }
            try:
                shaped = stack.enter_context(
                    shaped_s3(args.link, args.delay_ms, credentials, args.dir)
                )
            except LinkError as err:
                raise SystemExit(f"fetch --link: {err}") from None
            os.environ.update(credentials)
            os.environ["AWS_ENDPOINT_URL_S3"] = endpoint = shaped.endpoint
            os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
            where = f"S3 {endpoint} behind a veth shaped to {args.link}, {args.delay_ms} ms delay"
            server = shaped.server_session
            device = shaped.host_device
        else:
            devstack.up()
            devstack.export_s3_environment()
            endpoint = os.environ["AWS_ENDPOINT_URL_S3"]
            where = f"S3 {endpoint} on loopback"
            server = stack_server_session()
            device = None
        if args.dir:
            where += f", folders in {args.dir}"
        bench(args, endpoint, where, server, device)


def bench(
    args: argparse.Namespace, endpoint: str, where: str, server: int, device: str | None
) -> None:
    """Upload and lock the model where needed, run the tools in turn, print medians and ratios."""
    shape = SyntheticShape(shard_bytes=args.shard_mib * MiB, engram_bytes=args.engram_mib * MiB)
    source = f"s3://models/perf/synthetic-{args.shard_mib}-{args.engram_mib}"
    lock = ensure_model(s3_client(), source, shape)
    print(f"model: {len(lock.files)} files, {lock.size / GiB:.2f} GiB, {where}")
    options = FetchOptions(
        part_size=int(args.part_mib * MiB), workers=args.workers, files_at_once=args.files_at_once
    )
    tools = {
        "sparkforge (sha256 verified)": lambda d: run_ours(lock, d, options),
        "s5cmd cp": lambda d: run_s5cmd(source, d, endpoint),
        "s5cmd cp + sync": lambda d: run_s5cmd_synced(source, d, endpoint),
    }
    if (BIN / "aws").exists():
        tools["aws s3 cp --recursive"] = lambda d: run_aws(source, d, endpoint)
    else:
        print(f"  no aws in {BIN}: aws s3 cp left out of this run")
    if not args.link:
        no_fsync = dataclasses.replace(options, durable=False)
        tools["sparkforge, no fsync"] = lambda d: run_ours(lock, d, no_fsync)
        tools["s5cmd + sync + verify (2 thr)"] = lambda d: run_s5cmd_synced_verified(
            lock, source, d, endpoint
        )
    times: dict[str, list[float]] = {name: [] for name in tools}
    # CPU seconds of the client and of the S3 server per run: on 2 cores they share one budget.
    cpu: dict[str, list[tuple[float, float]]] = {name: [] for name in tools}
    unwritten: dict[str, list[int]] = {name: [] for name in tools}
    # With --link: the link's rate over each run, (seconds, bit/s) every 10 ms.
    series: dict[str, list[list[tuple[float, float]]]] = {name: [] for name in tools}
    link_rate = bits_per_second(args.link) if args.link else 0.0
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="fetch-bench-") as tmp:
        for run in range(args.runs):
            for name, tool in tools.items():
                dest = Path(tmp) / "dest"
                dest.mkdir()
                os.sync()  # no run pays for the writeback of the one before
                with LinkMeter(device) as meter:
                    start, client, served = time.perf_counter(), own_cpu(), session_cpu(server)
                    tool(dest)
                    took = time.perf_counter() - start
                used = (own_cpu() - client, session_cpu(server) - served)
                unwritten[name].append(unwritten_bytes())
                times[name].append(took)
                cpu[name].append(used)
                print(
                    f"  run {run + 1} {name:30s} {took:6.2f} s, CPU client {used[0]:6.2f} s,"
                    f" server {used[1]:6.2f} s, not yet on disk {unwritten[name][-1] / GiB:5.2f}"
                    " GiB",
                    flush=True,
                )
                if device:
                    series[name].append(meter.rates(start))
                    print(f"  {'':36s} {link_use(series[name][-1], took, link_rate)}")
                shutil.rmtree(dest)
    medians = {name: statistics.median(t) for name, t in times.items()}
    print(f"medians over {args.runs} alternating runs ({os.cpu_count()} cores), {where}:")
    gb = lock.size / 1e9
    for name, t in medians.items():
        client = statistics.median(c for c, _ in cpu[name]) / gb
        served = statistics.median(s for _, s in cpu[name]) / gb
        left = statistics.median(unwritten[name]) / GiB
        print(
            f"  {name:30s} {t:6.2f} s  {lock.size / t / 1e6:7.0f} MB/s"
            f"  CPU s/GB: client {client:5.2f}, server {served:5.2f}"
            f"  not yet on disk at the end: {left:4.2f} GiB"
        )
    rate = sha256_rate()
    print(f"  sha256 on one core here: {rate / 1e6:.0f} MB/s ({1e9 / rate:.2f} CPU s/GB)")
    print_cpu_floor(cpu["s5cmd cp"], medians["s5cmd cp"], lock.size / rate)
    ours = medians["sparkforge (sha256 verified)"]
    target = 1.02 if args.link else 1.0
    print(f"  ours / s5cmd          = {ours / medians['s5cmd cp']:.2f} (target <= {target})")
    print(f"  ours / (s5cmd + sync) = {ours / medians['s5cmd cp + sync']:.2f}")
    if "aws s3 cp --recursive" in medians:
        print(f"  ours / aws            = {ours / medians['aws s3 cp --recursive']:.2f}")
    if not args.link:
        lazy = medians["sparkforge, no fsync"]
        print(f"  ours without fsync / s5cmd = {lazy / medians['s5cmd cp']:.2f}")
        both = medians["s5cmd + sync + verify (2 thr)"]
        print(f"  ours / (s5cmd + sync + verify) = {ours / both:.2f} (target <= 1.0)")
    gib = lock.size / GiB
    path = bar_chart(
        f"fetch-{args.link}" if args.link else "fetch",
        f"Fetch of {len(lock.files)} files, {gib:.2f} GiB, {where}"
        f" (median of {args.runs}, {os.cpu_count()} cores)",
        "seconds (lower is better)",
        medians,
    )
    print(f"plot: {path}")
    if device:
        # Each tool's run of median time: where the link sat idle (start, tail) shows.
        middle = {
            name: runs[times[name].index(sorted(times[name])[len(runs) // 2])]
            for name, runs in series.items()
        }
        gbit = {name: [(t, bps / 1e9) for t, bps in points] for name, points in middle.items()}
        path = rate_chart(
            f"fetch-{args.link}-link",
            f"The link during each tool's median run, {where}",
            gbit,
        )
        print(f"plot: {path}")


if __name__ == "__main__":
    main()
