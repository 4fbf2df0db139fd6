"""Ring staging in a simulated ring (devstack/ringnet.py): the plan over its links, and members.

The ring tests and tests/perf/ring_staging.py both plan a lock over a RingNet's links and start
processes in the members' namespaces, each reaching S3 over its own shaped uplink; this is that
code, once. Run as a script it is the baseline a member is compared with: the whole lock from
S3 with fetch_lock, every file sha256-verified as it streams, as `doit stage_weights` fetches.

Run: python tests/perf/ringrun.py --lock LOCK.yaml --root WEIGHTS [--part-mib 4] [--times F]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from devstack.ringnet import RingNet
from pipelines.core.modellock import Lock, dump_lock, load_lock
from pipelines.core.progress import NoProgress
from pipelines.engine.statcache import StatCache
from pipelines.stages.weights.blobs import BlobStore
from pipelines.stages.weights.fetch import fetch_lock
from pipelines.stages.weights.options import FetchOptions
from pipelines.stages.weights.ringplan import RingNode, RingPlan, plan_json, plan_ring
from pipelines.stages.weights.s3 import s3_client

REPO = Path(__file__).resolve().parents[2]
PORT = 8098  # every member's blob server, on its link addresses
REGION = "us-east-1"


def ring_nodes(net: RingNet) -> list[RingNode]:
    """A node per member, named m<rank>, with its address on each link as the profile gives it."""
    size = len(net.members)
    return [
        RingNode(f"m{m.rank}", m.links[(m.rank + 1) % size][0], {
            f"m{peer}": mine for peer, (mine, _) in m.links.items()
        })
        for m in net.members
    ]  # fmt: skip


def write_plan(net: RingNet, lock: Lock, path: Path) -> RingPlan:
    """The plan of lock over net's links, written to path as every member reads it."""
    entries = [(e.name, e.size, e.sha256) for e in lock.files]
    lock_sha256 = hashlib.sha256(dump_lock(lock).encode()).hexdigest()
    plan = plan_ring(lock.model, lock.source, lock_sha256, entries, ring_nodes(net), PORT)
    path.write_text(plan_json(plan))
    return plan


def member_env(net: RingNet, rank: int, credentials: dict[str, str]) -> dict[str, str]:
    """This environment with the AWS chain pointed at S3 over member rank's own uplink."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env |= credentials
    env |= {"AWS_ENDPOINT_URL": net.members[rank].s3_endpoint, "AWS_DEFAULT_REGION": REGION}
    return env


def start_in(
    net: RingNet, rank: int, credentials: dict[str, str], argv: list[str], log: Path
) -> subprocess.Popen:
    """argv in member rank's namespace, from the checkout, its output appended to log."""
    with open(log, "ab") as out:
        return net.popen(
            rank,
            argv,
            env=member_env(net, rank, credentials),
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def start_member(
    net: RingNet,
    rank: int,
    credentials: dict[str, str],
    plan_file: Path,
    root: Path,
    log: Path,
    part_mib: int = 4,
    peer_wait_s: float = 60,
    interval: float = 1,
    max_mbps: float | None = None,
) -> subprocess.Popen:
    """The ring member's command (stages/weights/ring.py) for rank, in its namespace, S3 on its
    uplink."""
    argv = [sys.executable, "-m", "pipelines.stages.weights.ring", "--plan", str(plan_file),
            "--rank", str(rank), "--root", str(root), "--interval", str(interval),
            "--part-mib", str(part_mib), "--peer-wait-s", str(peer_wait_s)]  # fmt: skip
    argv += ["--max-mbps", str(max_mbps)] if max_mbps else []
    return start_in(net, rank, credentials, argv, log)


def start_fetch_all(
    net: RingNet,
    rank: int,
    credentials: dict[str, str],
    lock_file: Path,
    root: Path,
    log: Path,
    part_mib: int = 4,
    times: Path | None = None,
) -> subprocess.Popen:
    """This file as a script for member rank: the whole lock from S3, on its uplink alone."""
    argv = [sys.executable, str(Path(__file__).resolve()), "--lock", str(lock_file),
            "--root", str(root), "--part-mib", str(part_mib)]  # fmt: skip
    argv += ["--times", str(times)] if times else []
    return start_in(net, rank, credentials, argv, log)


def fetch_all(lock_file: Path, root: Path, part_mib: int, times: Path | None = None) -> str:
    """fetch_lock of the whole lock into a blob store at root; one line on what it did.

    times, if given, gets {"start", "end"} of the fetch in time.monotonic() seconds: one clock
    for every namespace, so the caller can tell this process's start-up from its fetch.
    """
    lock = load_lock(lock_file)
    blobs = BlobStore(root, StatCache(root / "statcache.sqlite3"))
    start = time.monotonic()
    options = FetchOptions(part_size=part_mib << 20)
    report = fetch_lock(s3_client(), lock, blobs, options, progress_factory=NoProgress)
    end = time.monotonic()
    if times is not None:
        times.write_text(json.dumps({"start": start, "end": end}))
    return (
        f"fetch_all: {len(report.fetched)} files, {report.downloaded / 1e6:.1f} MB from S3,"
        f" sha256 verified, in {end - start:.2f} s"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lock", type=Path, required=True)
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--part-mib", type=int, default=4)
    parser.add_argument("--times", type=Path, help="write the fetch's start and end here")
    args = parser.parse_args()
    print(fetch_all(args.lock, args.root, args.part_mib, args.times), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
