"""Watching the ring's peers: a thread per peer polls its /status.json, so a peer that accepts
and never answers stalls only its own thread, never the member's loops that read the statuses."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Annotated, Any

import msgspec
import urllib3

from pipelines.core.errors import PipelineError
from pipelines.core.files import MiB, decode_json
from pipelines.core.modellock import Sha256
from pipelines.stages.weights.sources import PeerSource

# A status.json is a few KB from a neighbour: a peer that takes longer is hung, not busy.
STATUS_TIMEOUT_S = 3.0
# ... naming each blob the peer has in 67 bytes: some 140 KiB for 2,000 files. An answer
# larger than this is not a status, and is never read past it.
STATUS_MAX_BYTES = 4 * MiB
Count = Annotated[int, msgspec.Meta(ge=0, le=1 << 62)]


class BadPeerStatus(PipelineError):
    """A peer's status.json that is not one a member writes: the peer is taken to have nothing."""


class PeerStatus(msgspec.Struct):
    """The fields of a peer's status.json that this member reads, each of its type (write_status
    writes them; others are ignored)."""

    published: list[Sha256] = []
    done: Count = 0
    from_s3: Count = 0
    from_peers: Count = 0
    complete: bool = False
    knows_complete: list[int] = []


def read_peer_status(data: bytes) -> dict[str, Any]:
    """A peer's status.json as plain data with every field type-checked, or BadPeerStatus."""
    if len(data) > STATUS_MAX_BYTES:
        raise BadPeerStatus(f"larger than {STATUS_MAX_BYTES // MiB} MiB; taken as having nothing")
    try:
        status = decode_json(data, "status.json", BadPeerStatus, PeerStatus)
    except BadPeerStatus as err:
        raise BadPeerStatus(f"{err}; taken as having nothing") from None
    return msgspec.to_builtins(status)  # type: ignore[no-any-return]


class PeerWatch:
    """The peers' statuses as last polled, and which peers answer."""

    def __init__(
        self,
        peers: dict[int, PeerSource],
        nodes: dict[int, str],
        poll_s: float,
        say: Callable[[str], None],
    ):
        self.peers, self.nodes, self.poll_s, self.say = peers, nodes, poll_s, say
        # Written only by the pollers, each write a new dict or set under _seen: the member's
        # loops read them without a lock and never see one change as they iterate it.
        self.statuses: dict[int, dict[str, Any]] = {}  # peer -> its /status.json
        self.fetching: dict[int, float] = {}  # peer -> when its bytes from S3 last grew
        self.answering: set[int] = set()
        self._seen = threading.Lock()
        self._stop = threading.Event()
        self._pollers: list[threading.Thread] = []

    def start(self) -> None:
        """A thread per peer polling its status: a hung peer stalls only its own thread, never
        the loop that schedules files and writes this member's status."""
        self._stop.clear()
        for p in self.peers:
            thread = threading.Thread(target=self.poll, args=(p,), name=f"status-{p}", daemon=True)
            thread.start()
            self._pollers.append(thread)

    def stop(self) -> None:
        """Stop the pollers; one inside a request ends with its timeout (daemon: never waited
        for past that)."""
        self._stop.set()
        for thread in self._pollers:
            thread.join(timeout=2 * STATUS_TIMEOUT_S)
        self._pollers = []

    def poll(self, p: int) -> None:
        """Refresh peer p's status every poll_s until told to stop."""
        said = None
        while not self._stop.is_set():
            try:
                self.refresh(p)
            except Exception as err:  # noqa: BLE001 - a dead poller would leave p unseen, unsaid
                if str(err) != said:  # once per new error, not once per poll
                    said = str(err)
                    self.say(f"reading {self.nodes[p]}'s status: {err}; trying again")
            self._stop.wait(self.poll_s)

    def refresh(self, p: int) -> None:
        """Peer p's status.json; one not answering keeps its progress but serves nothing."""
        peer = self.peers[p]
        try:
            response = peer.pool.request(
                "GET",
                f"{peer.base}/status.json",
                retries=False,
                timeout=STATUS_TIMEOUT_S,
                preload_content=False,
            )
            try:
                data = response.read(STATUS_MAX_BYTES + 1)
                if len(data) > STATUS_MAX_BYTES:
                    response.close()  # the rest unread: the connection cannot be used again
            finally:
                response.release_conn()
        except urllib3.exceptions.HTTPError:
            # Down or hung (killed, restarting, or done and gone): not asked for files until it
            # answers again.
            with self._seen:
                self.answering = self.answering - {p}
                if p in self.statuses:
                    self.statuses = {**self.statuses, p: {**self.statuses[p], "published": []}}
            return
        status, bad = None, None
        if response.status == 200:
            try:
                status = read_peer_status(data)
            except BadPeerStatus as err:
                status, bad = {}, err  # a peer that says nothing usable has nothing
        with self._seen:
            self.answering = self.answering | {p}
            if status is not None:
                before = self.statuses.get(p, {}).get("from_s3")
                if bad is None and status.get("from_s3") != before:
                    self.fetching = {**self.fetching, p: time.monotonic()}
                self.statuses = {**self.statuses, p: status}
        if bad is not None:
            raise bad  # said once by poll_peer, as any error of a poll

    def none_need(self, rank: int) -> bool:
        """True when every peer is done and knows member rank is done (or left, done)."""
        return all(self.needs_nothing(p, rank) for p in self.peers)

    def needs_nothing(self, p: int, rank: int) -> bool:
        """True when peer p is done and knows member rank is done (or left, done)."""
        seen = self.statuses.get(p, {})
        if not seen.get("complete"):
            return False
        return p not in self.answering or rank in seen.get("knows_complete", ())

    def progress(self) -> dict[int, tuple[Any, Any]]:
        """Each peer's (complete, done) as last seen: what tells a ring still moving."""
        return {p: (s.get("complete"), s.get("done")) for p, s in self.statuses.items()}
