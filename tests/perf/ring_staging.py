"""Benchmark: staging one model on a ring of three, the ring (S3 once) vs each member from S3.

Run: .venv/bin/python tests/perf/ring_staging.py [--runs 3] [--uplink 500mbit] [--link RATE]
     [--shard-mib 4] [--engram-mib 96] [--part-mib 4] [--peer-wait-s 60] [--name ring_staging]
     (as root: network namespaces and htb, as devstack/ringnet.py needs)

Inside one simulated ring (devstack/ringnet.py: SeaweedFS in a namespace of its own, each member
behind its own uplink shaped to --uplink, a full mesh of member links shaped to --link or left
unshaped) the synthetic model is uploaded, sized so the uplink dominates, and locked (fetch.py's
ensure_model). Then both ways of putting it on all three members run in turn, --runs times
each, the order flipped every run, each into fresh folders: "ring", `python -m
pipelines.stages.weights.ring` per member (its share from S3, the rest from its peers); "each
from S3", fetch_lock of the whole model per member, all three at once (tests/perf/ringrun.py as
a script).
Both verify sha256 while they stream; after every run each member's blobs are hashed again
here, outside the timing, and a run with a missing or wrong blob fails the benchmark.

Per run, from the first member's start: ready_s, when the last member is ready to fetch
(interpreter up, modules imported; ring: its blob server starting, status.json first written;
each: fetch_lock called); s3_part_s, when the last member has its part from S3
(ring: its status.json's from_s3 reaches its planned share; each: its exit); staged_s, when the
last member has every file verified (ring: status.json says complete; each: its exit); wall_s,
when the last member has exited (a ring member keeps serving until its peers are done).
s3_bytes: bytes the S3 namespace sent over the member uplinks, counted at the server, HTTP
included; link_bytes: bytes over the member links (peer blobs and status polls). The table
(per run and medians, and the ratios ring / each) is printed and written with the raw numbers
to tests/perf/out/NAME.{md,json}, plotted as tests/perf/out/NAME.png; member logs of the last
invocation are kept under tests/perf/out/NAME/ (NAME: --name, ring_staging by default).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import matplotlib.pyplot as plt  # noqa: E402
import ringrun  # noqa: E402
from fetch import ensure_model  # noqa: E402
from plot import OUT  # noqa: E402  (Agg backend set there)

from devstack.netns import LinkError, bits_per_second  # noqa: E402
from devstack.ringnet import RingNet, default_scratch, refused_here, ring_network  # noqa: E402
from pipelines.core.files import hash_file  # noqa: E402
from pipelines.core.modellock import Lock, write_lock  # noqa: E402
from pipelines.stages.weights.ringplan import RingPlan  # noqa: E402
from pipelines.stages.weights.synthetic import SyntheticShape  # noqa: E402

MiB = 1 << 20
MEMBERS = 3
RING, EACH = "ring", "each from S3"
MODES = (RING, EACH)
POLL_S = 0.05
TIMEOUT_S = 900  # one run of one mode, all members
SECONDS = ("ready_s", "s3_part_s", "staged_s", "wall_s")  # the marks of a run, in order
COLORS = {RING: "#4c72b0", EACH: "#999999"}


class StagingTestbed:
    """The ring, the model in its S3, and where runs keep their folders."""

    def __init__(self, net: RingNet, credentials: dict[str, str], lock: Lock, args):
        self.net, self.credentials, self.lock, self.args = net, credentials, lock, args
        self.work = net.data / "staging"
        self.work.mkdir()
        self.lock_file = self.work / "lock.yaml"
        write_lock(lock, self.lock_file)
        self.plan_file = self.work / "plan.json"
        self.plan: RingPlan = ringrun.write_plan(net, lock, self.plan_file)
        self.shares = [sum(f.size for f in self.plan.from_s3(r)) for r in range(MEMBERS)]

    def start(self, mode: str, rank: int, root: Path, log: Path) -> subprocess.Popen:
        """Member rank's process for one mode, in its namespace (each: its times next to root)."""
        if mode == RING:
            return ringrun.start_member(
                self.net, rank, self.credentials, self.plan_file, root, log,
                part_mib=self.args.part_mib, peer_wait_s=self.args.peer_wait_s, interval=2,
            )  # fmt: skip
        return ringrun.start_fetch_all(
            self.net, rank, self.credentials, self.lock_file, root, log, self.args.part_mib,
            times=times_file(root),
        )  # fmt: skip

    def run(self, mode: str, run: int) -> dict:
        """All members through one mode into fresh folders: timings, bytes, blobs verified."""
        slug = "ring" if mode == RING else "each"
        folder = self.work / f"run{run}-{slug}"
        folder.mkdir()
        roots = {r: folder / f"m{r}" for r in range(MEMBERS)}
        logs = {r: OUT / self.args.name / f"run{run}-{slug}-m{r}.log" for r in range(MEMBERS)}
        os.sync()  # no run pays for the writeback of the one before
        s3_before = self.net.s3_bytes_served()
        links_before = sum(self.net.link_bytes().values())
        start = time.monotonic()
        members = {r: self.start(mode, r, roots[r], logs[r]) for r in range(MEMBERS)}
        marks = self.watch(mode, members, roots, logs, start)
        s3_bytes = self.net.s3_bytes_served() - s3_before
        link_bytes = sum(self.net.link_bytes().values()) - links_before
        if mode == EACH:
            for r, mark in enumerate(marks):
                mark["ready_s"] = json.loads(times_file(roots[r]).read_text())["start"] - start
        problems = [p for r in range(MEMBERS) for p in wrong_blobs(roots[r], self.lock, r)]
        ring_status = [status(roots[r]) for r in range(MEMBERS)] if mode == RING else []
        shutil.rmtree(folder)
        return {
            "run": run,
            "mode": mode,
            "ready_s": max(m["ready_s"] for m in marks),
            "s3_part_s": max(m["s3_part_s"] for m in marks),
            "staged_s": max(m["staged_s"] for m in marks),
            "wall_s": max(m["exit_s"] for m in marks),
            "s3_bytes": s3_bytes,
            "link_bytes": link_bytes,
            "verified": not problems,
            "problems": problems,
            "members": [
                m | {k: s.get(k) for k in ("from_s3", "from_peers")}
                for m, s in zip(marks, ring_status or [{}] * MEMBERS, strict=True)
            ],
        }

    def watch(
        self,
        mode: str,
        members: dict[int, subprocess.Popen],
        roots: dict[int, Path],
        logs: dict[int, Path],
        start: float,
    ) -> list[dict]:
        """Seconds from start to each member's S3 part, complete set and exit (ring: ready)."""
        marks = [{"rank": r} for r in range(MEMBERS)]
        while not all("exit_s" in m for m in marks):
            now = time.monotonic() - start
            if now > TIMEOUT_S:
                kill(members)
                raise SystemExit(f"{mode}: members still running after {TIMEOUT_S} s")
            for r, process in members.items():
                mark = marks[r]
                if mode == RING and "staged_s" not in mark:
                    state = status(roots[r])
                    if state:
                        mark.setdefault("ready_s", now)
                    if "s3_part_s" not in mark and state.get("from_s3", 0) >= self.shares[r]:
                        mark["s3_part_s"] = now
                    if state.get("complete"):
                        mark["staged_s"] = now
                        mark.setdefault("s3_part_s", now)
                if "exit_s" not in mark and process.poll() is not None:
                    if process.returncode != 0:
                        kill(members)
                        tail = logs[r].read_text()[-3000:]
                        raise SystemExit(f"{mode}: member {r} exited {process.returncode}:\n{tail}")
                    mark["exit_s"] = now
                    mark.setdefault("staged_s", now)
                    mark.setdefault("s3_part_s", now)
            time.sleep(POLL_S)
        return marks


def times_file(root: Path) -> Path:
    """Where an each-from-S3 member writes when its fetch started and ended."""
    return root.with_name(f"{root.name}.times.json")


def status(root: Path) -> dict:
    """A ring member's status.json as it last wrote it ({} before it first does)."""
    try:
        return json.loads((root / "ring" / "status.json").read_text())
    except (FileNotFoundError, ValueError):
        return {}


def wrong_blobs(root: Path, lock: Lock, rank: int) -> list[str]:
    """What is wrong with a member's blob store: locked files missing, bytes not their sha256."""
    folder = root / "blobs" / "sha256"
    blobs = sorted(folder.iterdir()) if folder.is_dir() else []
    with ThreadPoolExecutor(2) as pool:
        digests = dict(zip(blobs, pool.map(hash_file, blobs), strict=True))
    problems = [f"m{rank}: {b.name}: bytes hash to {d}" for b, d in digests.items() if d != b.name]
    have = {b.name for b in blobs}
    problems += [f"m{rank}: {e.name}: missing" for e in lock.files if e.sha256 not in have]
    return problems


def kill(members: dict[int, subprocess.Popen]) -> None:
    """SIGKILL to every member's process group (ring_network reaps whatever is left)."""
    for process in members.values():
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)


def progress_line(row: dict) -> str:
    """One run of one mode, as it ends."""
    seconds = ", ".join(f"{k.removesuffix('_s')} {row[k]:.2f} s" for k in SECONDS)
    return f"{seconds}; S3 {row['s3_bytes'] / 1e6:.1f} MB, links {row['link_bytes'] / 1e6:.1f} MB"


def medians(rows: list[dict]) -> dict[str, dict[str, float]]:
    """Per mode, the median of each measured quantity over its runs."""
    keys = (*SECONDS, "s3_bytes", "link_bytes")
    return {
        mode: {k: statistics.median(r[k] for r in rows if r["mode"] == mode) for k in keys}
        for mode in MODES
    }


def ratios(median: dict[str, dict[str, float]]) -> dict[str, float]:
    """ring / each from S3, of the medians."""
    ring, each = median[RING], median[EACH]
    return {k: ring[k] / each[k] for k in ("staged_s", "wall_s", "s3_bytes")}


def markdown(rows: list[dict], median: dict, ratio: dict, notes: list[str]) -> str:
    """The table: a row per run and mode, then the medians; the ratios and notes below."""
    lines = [
        "| run | mode | ready s | S3 part done s | all staged s | wall s | S3 MB served | link MB"
        " | blobs |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]

    def row(run: str, mode: str, values: dict, verified: str) -> str:
        return (
            f"| {run} | {mode} | "
            + " | ".join(f"{values[k]:.2f}" for k in SECONDS)
            + f" | {values['s3_bytes'] / 1e6:.1f} | {values['link_bytes'] / 1e6:.1f} | {verified} |"
        )

    for r in rows:
        lines.append(row(str(r["run"]), r["mode"], r, "verified" if r["verified"] else "WRONG"))
    for mode in MODES:
        lines.append(row("median", mode, median[mode], ""))
    lines += [
        "",
        f"- ring / each from S3, wall time: {ratio['wall_s']:.2f}"
        f" (all staged: {ratio['staged_s']:.2f})",
        f"- ring / each from S3, bytes S3 served: {ratio['s3_bytes']:.3f}",
        *(f"- {n}" for n in notes),
    ]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], median: dict, title: str, path: Path) -> None:
    """Grouped bars of the medians per mode (seconds; GB), each run's value as a dot."""
    panels = [
        ("seconds (lower is better)", 1, {"ready": "ready_s", "S3 part done": "s3_part_s",
                                          "all staged": "staged_s", "wall": "wall_s"}),
        ("GB", 1e9, {"served by S3": "s3_bytes", "over ring links": "link_bytes"}),
    ]  # fmt: skip
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.2), gridspec_kw={"width_ratios": [4, 2]})
    width = 0.8 / len(MODES)
    for ax, (unit, scale, groups) in zip(axes, panels, strict=True):
        for i, mode in enumerate(MODES):
            xs = [j + (i - (len(MODES) - 1) / 2) * width for j in range(len(groups))]
            heights = [median[mode][k] / scale for k in groups.values()]
            bars = ax.bar(xs, heights, width, label=mode, color=COLORS[mode])
            ax.bar_label(bars, fmt="%.2f", fontsize=8, padding=2)
            for x, k in zip(xs, groups.values(), strict=True):
                runs = [r[k] / scale for r in rows if r["mode"] == mode]
                ax.plot([x] * len(runs), runs, "k.", markersize=4)
        ax.set_xticks(range(len(groups)), list(groups))
        ax.set_ylabel(unit)
        ax.margins(y=0.15)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="runs of each mode, alternating")
    parser.add_argument("--uplink", default="500mbit", help="each member's path to S3")
    parser.add_argument("--link", default=None, help="member links' rate (default: unshaped)")
    parser.add_argument("--shard-mib", type=int, default=4, help="each of the 46 shards")
    parser.add_argument("--engram-mib", type=int, default=96, help="each of the 2 Engram shards")
    parser.add_argument("--part-mib", type=int, default=4, help="range size, both modes")
    parser.add_argument("--peer-wait-s", type=float, default=60, help="ring members' wait")
    parser.add_argument("--name", default="ring_staging", help="outputs' name in tests/perf/out")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    credentials = {
        "AWS_ACCESS_KEY_ID": "ring-bench",
        "AWS_SECRET_ACCESS_KEY": secrets.token_hex(16),
    }
    shutil.rmtree(OUT / args.name, ignore_errors=True)
    (OUT / args.name).mkdir(parents=True)
    load_before = os.getloadavg()
    try:
        with ring_network(MEMBERS, args.uplink, credentials, default_scratch(), args.link) as net:
            host = net.host_s3(credentials)
            shape = SyntheticShape(args.shard_mib * MiB, args.engram_mib * MiB)
            source = f"s3://models/perf/ring-{args.shard_mib}-{args.engram_mib}"
            lock = ensure_model(host, source, shape)
            bench = StagingTestbed(net, credentials, lock, args)
            rows = []
            for run in range(1, args.runs + 1):
                for mode in MODES if run % 2 else MODES[::-1]:
                    row = bench.run(mode, run)
                    rows.append(row)
                    print(f"  run {run} {mode:13s} {progress_line(row)}", flush=True)
            shares = bench.shares
    except LinkError as err:
        if refused_here(err):
            raise SystemExit(
                f"ring_staging: no network namespaces here (CAP_NET_ADMIN): {err}"
            ) from None
        raise SystemExit(f"ring_staging: {err}") from None
    load_after = os.getloadavg()
    report(args, lock, shares, rows, load_before, load_after)
    return 0 if all(r["verified"] for r in rows) else 1


def report(args, lock: Lock, shares: list[int], rows: list[dict], before, after) -> None:
    """Print the table and write it, the JSON and the plot under tests/perf/out/."""
    median = medians(rows)
    ratio = ratios(median)
    rate = bits_per_second(args.uplink) / 8
    where = (
        f"{len(lock.files)} files, {lock.size / 1e6:.1f} MB; 3 members, uplinks {args.uplink},"
        f" member links {args.link or 'unshaped'}; {os.cpu_count()} cores"
    )
    notes = [
        f"model: {where}; {args.runs} runs per mode, alternating (order flipped every run)",
        f"uplink floor: each from S3 {lock.size / rate:.2f} s (the model over one uplink),"
        f" ring {max(shares) / rate:.2f} s (the largest planned S3 share,"
        f" {max(shares) / 1e6:.1f} MB, over one uplink)",
        "load average (1, 5, 15 min): before "
        + ", ".join(f"{v:.2f}" for v in before)
        + "; after "
        + ", ".join(f"{v:.2f}" for v in after),
    ]
    problems = [p for r in rows for p in r["problems"]]
    notes += [f"WRONG: {p}" for p in problems[:10]]
    table = markdown(rows, median, ratio, notes)
    print()
    print(table)
    (OUT / f"{args.name}.md").write_text(table)
    results = {
        "settings": dict(vars(args)),
        "model": {"files": len(lock.files), "bytes": lock.size, "source": lock.source},
        "planned_s3_shares": shares,
        "cores": os.cpu_count(),
        "load_before": before,
        "load_after": after,
        "rows": rows,
        "medians": median,
        "ratios_ring_over_each": ratio,
    }
    (OUT / f"{args.name}.json").write_text(json.dumps(results, indent=1) + "\n")
    title = f"Staging {where} (median of {args.runs}; dots: runs)"
    plot(rows, median, title, OUT / f"{args.name}.png")
    print(f"written: {OUT / args.name}.md, .json, .png; member logs: {OUT / args.name}/")


if __name__ == "__main__":
    sys.exit(main())
