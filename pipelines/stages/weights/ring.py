"""Ring staging, one member's side: fetch its share from S3, the rest from peers, serve its blobs.

Every member runs this with the same plan (ringplan.py) and its own rank. It starts its blob
server (blobserver.py), fetches the files it owns from S3 and, at the same time, every other
file from the first peer on its route that says it has the file (each peer's /status.json lists
its published blobs). Bytes from a peer go through the same fetch as bytes from S3: hashed as
they stream, a verified prefix on disk that a restart resumes, published only when the sha256
matches the lock. A peer whose bytes do not match is not asked for that file again; when no
peer is left for a file, or none has had it for peer_wait_s, it comes from S3. A member that
is done keeps serving until every peer says it is done too. Peers' statuses are polled in a
thread per peer with a short timeout: a peer that accepts and never answers stalls nobody.

Run it as `python -m pipelines.stages.weights.ring --plan PLAN.json --rank N --root WEIGHTS`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

import urllib3

from pipelines.core.errors import BadInput, PipelineError, run_main
from pipelines.core.files import MiB, read_capped
from pipelines.core.modellock import LockEntry
from pipelines.core.progress import NoProgress, human_bytes, say, transfer_line
from pipelines.core.s3 import s3_errors
from pipelines.engine.statcache import StatCache
from pipelines.stages.weights.blobs import BlobStore
from pipelines.stages.weights.blobserver import BlobServer
from pipelines.stages.weights.fetch import Fetcher, LocalWriteError
from pipelines.stages.weights.options import FetchOptions
from pipelines.stages.weights.peerwatch import PeerWatch
from pipelines.stages.weights.publish import PublishError
from pipelines.stages.weights.ranges import SourceDown, Stopped
from pipelines.stages.weights.ringplan import S3, PlannedFile, RingPlan, load_plan
from pipelines.stages.weights.s3 import S3Url

if TYPE_CHECKING:
    from types_boto3_s3 import S3Client
from pipelines.stages.weights.sources import (
    PEER_READ_TIMEOUT_S,
    NotServed,
    PeerSource,
    PeerStalled,
    S3Source,
)

# A plan lists each file with its routes: some 100 KiB for 2,000 files on four members.
PLAN_MAX_BYTES = 16 * MiB


# A file's fetch as a pool runs it: its publication (a Future itself), or None when stored.
FileFetch = Future[Future[None] | None]


class RingError(PipelineError):
    """This member could not complete its set (one line per file that failed)."""


@dataclass
class MemberReport:
    """What one member did: files verified, bytes per source, files refused per peer."""

    verified: int = 0
    from_s3: int = 0
    from_peers: int = 0
    refused: dict[str, list[str]] = field(default_factory=dict)  # file -> peers refused
    failed: dict[str, str] = field(default_factory=dict)


def part_size(path: Path) -> int:
    """The size of a partial download, 0 when there is none."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def ring_transfer_line(done: int, from_s3: int, from_peers: int, total: int, took: float) -> str:
    """Bytes done of total, by source, the rate over the network and the ETA at that rate."""
    return transfer_line(
        done, total, from_s3 + from_peers, took, [("S3", from_s3), ("peers", from_peers)]
    )


def entry_of(f: PlannedFile) -> LockEntry:
    """The lock entry of a planned file."""
    return LockEntry(name=f.name, size=f.size, sha256=f.sha256)


class RingStager:
    """One member's side of a ring staging run: serves its blobs, fetches its share from S3 and the
    rest from peers."""

    def __init__(
        self,
        plan: RingPlan,
        rank: int,
        blobs: BlobStore,
        client: S3Client,
        options: FetchOptions,
        peer_wait_s: float = 1800.0,
        poll_s: float = 0.25,
        interval: float = 10.0,
        stream: TextIO = sys.stderr,
    ):
        self.plan, self.rank, self.blobs, self.options = plan, rank, blobs, options
        self.me = plan.members[rank]
        self.peer_wait_s, self.poll_s = peer_wait_s, poll_s
        self.interval, self.stream = interval, stream
        self.ring_dir = blobs.root / "ring"
        self.ring_dir.mkdir(exist_ok=True)
        self.s3 = S3Source(client, S3Url.parse(plan.source), options.retries)
        # Each peer is asked from this member's own address on the link to it: the address
        # that peer's server allows.
        peers = {
            p: PeerSource(
                urllib3.PoolManager(
                    maxsize=options.workers,
                    timeout=urllib3.Timeout(connect=5, read=PEER_READ_TIMEOUT_S),
                    source_address=(self.me.via[p], 0),
                ),
                f"http://{address}:{plan.port}",
                plan.members[p].node,
            )
            for p, address in self.me.reach.items()
        }
        self.total = sum(f.size for f in plan.files)
        self.report = MemberReport()
        self.watch = PeerWatch(peers, {p: plan.members[p].node for p in peers}, poll_s, self.say)
        self.stalled: set[int] = set()  # peers that went silent mid-body
        self.started = time.monotonic()
        self._printed = 0.0
        self._complete = False
        self.fetchers: list[Fetcher] = []
        self.done = 0

    # --- the run ---------------------------------------------------------------------------

    def run(self) -> MemberReport:
        """Serve, fetch own files from S3 and the rest from peers, linger; raise on failures."""
        server = BlobServer(
            self.blobs.blobs, self.ring_dir, self.me.listen, self.me.allow, self.plan.port
        )
        entries = [entry_of(f) for f in self.plan.files]
        missing = {e.name for e in self.blobs.missing_entries(entries)}
        self.write_status()
        server.start()
        self.watch.start()
        try:
            self.say(
                f"serving on {', '.join(self.me.listen)}:{self.plan.port} to"
                f" {', '.join(self.me.allow) or 'nobody'}; {len(missing)} of"
                f" {len(self.plan.files)} files to fetch"
            )
            own = [f for f in self.plan.from_s3(self.rank) if f.name in missing]
            others = [f for f in self.plan.from_peers(self.rank) if f.name in missing]
            # Two fetchers, each with its own range pool: peer ranges must never make the S3
            # ranges wait, the uplink to S3 being the ring's scarce link.
            s3_side = Fetcher(self.s3, self.blobs, self.options, NoProgress())
            peer_side = Fetcher(self.s3, self.blobs, self.options, NoProgress())
            self.fetchers = [s3_side, peer_side]
            own_files = ThreadPoolExecutor(self.options.files_at_once, "s3-file")
            try:
                own_done = {
                    own_files.submit(s3_side.fetch_file, entry_of(f), self.s3): f for f in own
                }
                self.fetch_from_peers(others, peer_side, own_done)
                wait(own_done)
                for future, f in own_done.items():
                    try:
                        s3_side.settle(f.name, future.result())
                    except (Stopped, SourceDown) as err:
                        if not self.s3_down():  # else said once, below
                            self.report.failed[f.name] = str(err)
                    except PipelineError as err:
                        self.report.failed[f.name] = str(err)
            except BaseException:
                s3_side.stop.set()
                peer_side.stop.set()
                raise
            finally:
                own_files.shutdown(wait=True, cancel_futures=True)
                s3_side.close()
                peer_side.close()
            self.report.from_s3 = self.by_origin("s3")
            self.report.from_peers = self.by_origin("peers")
            self.report.verified = len(self.plan.files) - len(
                self.blobs.missing_entries([entry_of(f) for f in self.plan.files])
            )
            self._complete = not self.report.failed
            self.write_status()
            self.print_progress(force=True)
            down = self.s3_down()
            if down or self.report.failed:
                raise RingError(
                    "\n".join([*([down] if down else []), *self.report.failed.values()])
                )
            self.linger()
        finally:
            self.watch.stop()
            server.stop()
        return self.report

    def fetch_from_peers(
        self, files: list[PlannedFile], fetcher: Fetcher, own: dict[FileFetch, PlannedFile]
    ) -> None:
        """Each file from the first peer on its route that has it; S3 as the last resort."""
        pending = list(files)
        since = {f.name: time.monotonic() for f in files}
        refused: dict[str, set[int]] = {f.name: set() for f in files}
        inflight: dict[FileFetch, tuple[PlannedFile, int]] = {}
        pool = ThreadPoolExecutor(self.options.files_at_once, "peer-file")
        try:
            while pending or inflight or not all(f.done() for f in own):
                if self.s3_down():
                    # This member's share cannot come, so the ring cannot complete: waiting
                    # peer_wait_s for the others' files would only delay saying so.
                    fetcher.stop.set()
                    break
                for f in list(pending):
                    if len(inflight) >= self.options.files_at_once:
                        break
                    source = self.choose(f, refused[f.name], since[f.name])
                    if source is None:
                        continue
                    pending.remove(f)
                    reader = self.s3 if source == S3 else self.watch.peers[source]
                    inflight[pool.submit(fetcher.fetch_file, entry_of(f), reader)] = (f, source)
                done, _ = wait(inflight, timeout=self.poll_s, return_when=FIRST_COMPLETED)
                if not inflight:
                    time.sleep(self.poll_s)
                for future in done:
                    f, source = inflight.pop(future)
                    self.settle_peer_file(future, f, source, fetcher, pending, refused)
                self.write_status()
                self.print_progress()
        except BaseException:
            fetcher.stop.set()
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def settle_peer_file(
        self,
        future: FileFetch,
        f: PlannedFile,
        source: int,
        fetcher: Fetcher,
        pending: list[PlannedFile],
        refused: dict[str, set[int]],
    ) -> None:
        """Record a file's outcome; a peer that failed it is refused for it and it goes back."""
        try:
            fetcher.settle(f.name, future.result())
        except NotServed:
            pending.append(f)  # gone between its status and our GET: ask again
        except PeerStalled as err:
            # Hung, not wrong: every file it serves would stall alike, so none is asked of it.
            if source not in self.stalled:
                self.stalled = self.stalled | {source}
                node = self.plan.members[source].node
                self.say(f"{err}; asking {node} for nothing more")
            pending.append(f)
        except (Stopped, SourceDown) as err:
            if not self.s3_down():  # else said once, by run
                self.report.failed[f.name] = str(err)
        except (LocalWriteError, PublishError) as err:
            self.report.failed[f.name] = str(err)  # this disk's fault: no peer is to blame
        except PipelineError as err:
            if source == S3:
                self.report.failed[f.name] = str(err)
                return
            node = self.plan.members[source].node
            refused[f.name].add(source)
            self.report.refused.setdefault(f.name, []).append(node)
            self.say(f"refused {f.name} from {node}: {err}; asking another source")
            pending.append(f)

    def s3_down(self) -> str | None:
        """Why S3 refuses this member every object (no access, unreachable), once it has."""
        return next((f.report.halted for f in self.fetchers if f.report.halted), None)

    def choose(self, f: PlannedFile, refused: set[int], since: float) -> int | None:
        """The first peer on f's route that has it, S3 when none can, None to wait."""
        route = [
            p for p in f.routes[self.rank] if p != S3 and p not in refused and p not in self.stalled
        ]
        for p in route:
            if f.sha256 in self.watch.statuses.get(p, {}).get("published", ()):
                return p
        if not route:
            self.say(f"{f.name}: every peer on its route was refused; fetching it from S3")
            return S3
        # The wait runs from the owner's last S3 progress, not from this member's start: a 101 GB
        # shard that shares its owner's uplink takes longer than peer_wait_s to arrive, and
        # fetching it from S3 again would cost the ring what staging saves.
        if (
            time.monotonic() - max(since, self.watch.fetching.get(f.owner, since))
            > self.peer_wait_s
        ):
            self.say(
                f"{f.name}: no peer had it, and its owner fetched nothing from S3, for"
                f" {self.peer_wait_s:.0f} s; fetching from S3"
            )
            return S3
        return None

    def linger(self) -> None:
        """Keep serving until no peer needs this member, or none has changed for peer_wait_s.

        A peer needs it until the peer is done, and until the peer knows this member is done
        (else it would wait for this member in turn). A peer that no longer answers and was done
        when last seen has left: it needs nothing.
        """
        last, changed = None, time.monotonic()
        while True:
            self.write_status()
            if self.watch.none_need(self.rank):
                break
            view = self.watch.progress()
            if view != last:
                last, changed = view, time.monotonic()
            elif time.monotonic() - changed > self.peer_wait_s:
                self.say("peers stopped changing; no longer serving")
                break
            self.print_progress()
            time.sleep(self.poll_s)
        self.print_progress(force=True)

    # --- status and progress -----------------------------------------------------------------

    def write_status(self) -> None:
        """What this member has and how far it is, for its peers (served as /status.json)."""
        entries = [entry_of(f) for f in self.plan.files]
        missing = {e.locked_sha256 for e in self.blobs.missing_entries(entries)}
        # Bytes verified, plus the verified-order prefixes on disk: never more than the model,
        # whatever was downloaded and then refused.
        self.done = sum(e.locked_size for e in entries if e.sha256 not in missing) + sum(
            part_size(self.blobs.partial_file(sha)) for sha in missing
        )
        status = {
            "rank": self.rank,
            "node": self.me.node,
            "lock_sha256": self.plan.lock_sha256,
            "published": sorted(e.locked_sha256 for e in entries if e.sha256 not in missing),
            "done": self.done,
            "total": self.total,
            "from_s3": self.by_origin("s3"),
            "from_peers": self.by_origin("peers"),
            "read_back": sum(f.report.read_back for f in self.fetchers),
            "complete": self._complete,
            "knows_complete": sorted(
                [self.rank] * self._complete
                + [p for p, seen in self.watch.statuses.items() if seen.get("complete")]
            ),
        }
        # Renamed into place (peers never read half of it); not synced: it says what is now.
        tmp = self.ring_dir / f".status.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(status))
        os.replace(tmp, self.ring_dir / "status.json")

    def print_progress(self, force: bool = False) -> None:
        """A line every interval: this member's bytes by source, rate, ETA, and the ring's."""
        now = time.monotonic()
        if not force and now - self._printed < self.interval:
            return
        self._printed = now
        took = max(now - self.started, 1e-9)
        mine = (self.done, self.by_origin("s3"), self.by_origin("peers"))
        peers = [
            sum(s.get(key, 0) for s in self.watch.statuses.values())
            for key in ("done", "from_s3", "from_peers")
        ]
        ring = (mine[0] + peers[0], mine[1] + peers[1], mine[2] + peers[2])
        self.say(
            f"{ring_transfer_line(*mine, self.total, took)};"
            f" ring {ring_transfer_line(*ring, self.total * len(self.plan.members), took)}"
        )

    def by_origin(self, origin: str) -> int:
        """Bytes downloaded so far from one kind of source ("s3" or "peers")."""
        return sum(f.report.by_origin.get(origin, 0) for f in self.fetchers)

    def say(self, text: str) -> None:
        """One plain line, prefixed with this member's node."""
        say(f"stage_ring {self.me.node}", text, self.stream)


def stage_model(folder: Path, plan: RingPlan, blobs: BlobStore) -> None:
    """Link the model folder to the verified blobs and say which lock it now holds."""
    from pipelines.stages.weights.stage import stage

    # The record too under the folder's staging lock: no other stager sees one without the other.
    stage(folder, {f.name: f.sha256 for f in plan.files}, blobs, plan.lock_sha256)


def main(argv: list[str] | None = None) -> int:
    """The member's command line (run_main prints a failure's one line and exits with its code)."""
    parser = argparse.ArgumentParser(
        prog="python -m pipelines.stages.weights.ring", description=__doc__
    )
    parser.add_argument("--plan", type=Path, required=True, help="the ring plan (JSON)")
    parser.add_argument("--rank", type=int, required=True, help="this member's rank")
    parser.add_argument("--root", type=Path, required=True, help="the weights folder")
    parser.add_argument("--statcache", type=Path, help="default: ROOT/statcache.sqlite3")
    parser.add_argument("--peer-wait-s", type=float, help="default: the plan's (the profile's)")
    parser.add_argument("--interval", type=float, default=10.0, help="seconds between lines")
    parser.add_argument("--part-mib", type=int, default=32)
    parser.add_argument(
        "--max-mbps", type=float, help="cap this member's S3 download (megabits per second)"
    )
    parser.add_argument(
        "--stage-into",
        type=Path,
        help="once complete, make this folder the model (hard links to the blobs) and record"
        " the plan's lock beside it, as `doit stage` does",
    )
    args = parser.parse_args(argv)
    try:
        plan = load_plan(read_capped(args.plan, PLAN_MAX_BYTES, BadInput).decode())
    except (KeyError, TypeError, ValueError, RecursionError) as err:
        raise BadInput(
            f"{args.plan}: not a plan written by `doit plan_weights` ({type(err).__name__}: {err})"
        ) from None
    if not 0 <= args.rank < len(plan.members):
        raise BadInput(f"--rank {args.rank}: expected 0..{len(plan.members) - 1} ({args.plan})")
    from pipelines.stages.weights.s3 import s3_client

    blobs = BlobStore(args.root, StatCache(args.statcache or args.root / "statcache.sqlite3"))
    rate = args.max_mbps * 1e6 / 8 if args.max_mbps else None
    options = FetchOptions(part_size=args.part_mib << 20, max_rate=rate)
    with s3_errors(plan.source):
        client = s3_client()
        member = RingStager(
            plan,
            args.rank,
            blobs,
            client,
            options,
            args.peer_wait_s or plan.peer_wait_s,
            interval=args.interval,
        )
        report = member.run()
    if args.stage_into:
        stage_model(args.stage_into, plan, blobs)
        member.say(f"staged {args.stage_into} ({len(plan.files)} files)")
    member.say(
        f"done: {report.verified} files verified, {human_bytes(report.from_s3)} from S3,"
        f" {human_bytes(report.from_peers)} from peers"
    )
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    # In its container the member is the first process (PID 1), to which the kernel delivers no
    # signal it has no handler for: `docker stop`'s SIGTERM (stage_ring stopping the others when
    # one fails) would be ignored until the engine's SIGKILL. It stops as Ctrl-C stops: its
    # ranges end at their next read, what is verified is published, exit 130.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    run_main(main)
