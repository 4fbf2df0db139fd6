"""Ring staging's plan: who fetches which file from S3, and from which peers everyone else does.

A pure function of the lock's entries and the ring's members. Each file is fetched from S3 by
exactly one member (its owner; files go biggest first to the member with the fewest bytes so
far), so the ring takes one model's worth from S3. Every other member takes it from a peer it
can reach: a neighbour on a direct link of the ring when the profile names the links (a
switchless ring has no address every member reaches), else any member at its management
address. Among those, the one nearest the owner comes first: on a ring of four, the file walks
from its owner to both neighbours, and the member opposite takes it from either of them. S3
stays the last resort of every route, for a file no peer can serve intact.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from pipelines.core.errors import BadInput

S3 = -1  # the source index of the bucket in a route


@dataclass(frozen=True)
class RingNode:
    """A member as the plan sees it: its node, management address and addresses per link."""

    node: str
    address: str
    links: dict[str, str]  # neighbour node -> this member's address on the link to it


@dataclass(frozen=True)
class PlannedFile:
    """One locked file: its owner (fetches it from S3) and each member's route to it."""

    name: str
    size: int
    sha256: str
    owner: int
    routes: tuple[tuple[int, ...], ...]  # per member: peer ranks in order, then S3; (S3,) own


@dataclass(frozen=True)
class PlannedMember:
    """One member's side of the plan: where it listens, whom it serves, how it reaches peers."""

    rank: int
    node: str
    listen: tuple[str, ...]  # its addresses peers connect to
    allow: tuple[str, ...]  # the peers' addresses it serves (nobody else)
    reach: dict[int, str]  # peer rank -> the address to fetch from
    via: dict[int, str]  # peer rank -> its own address on the way there (what the peer allows)


@dataclass(frozen=True)
class RingPlan:
    """The whole ring's plan, as every member receives it."""

    model: str
    source: str
    lock_sha256: str
    port: int
    over: str  # "links" (the ring's direct links) or "management" (member addresses)
    members: tuple[PlannedMember, ...]
    files: tuple[PlannedFile, ...]
    peer_wait_s: float = 1800.0  # a file no peer has after this long comes from S3

    def from_s3(self, rank: int) -> list[PlannedFile]:
        """The files member rank fetches from S3, biggest first."""
        return [f for f in self.files if f.owner == rank]

    def from_peers(self, rank: int) -> list[PlannedFile]:
        """The files member rank takes from its peers."""
        return [f for f in self.files if f.owner != rank]


def neighbours(nodes: Sequence[RingNode]) -> list[list[int]]:
    """Each member's reachable peers: its linked neighbours, or every other member."""
    index = {n.node: rank for rank, n in enumerate(nodes)}
    if not any(n.links for n in nodes):
        return [[p for p in range(len(nodes)) if p != rank] for rank in range(len(nodes))]
    return [sorted(index[name] for name in n.links) for n in nodes]


def hops(adjacent: list[list[int]], start: int) -> list[int]:
    """Hop counts from start to every member (breadth first)."""
    distance = [-1] * len(adjacent)
    distance[start] = 0
    queue = deque([start])
    while queue:
        here = queue.popleft()
        for peer in adjacent[here]:
            if distance[peer] < 0:
                distance[peer] = distance[here] + 1
                queue.append(peer)
    return distance


def assign_owners(files: Sequence[tuple[str, int]], members: int) -> dict[str, int]:
    """Biggest file first to the member with the fewest bytes so far (ties: lowest rank)."""
    load = [0] * members
    owners = {}
    for name, size in sorted(files, key=lambda f: (-f[1], f[0])):
        rank = min(range(members), key=lambda r: (load[r], r))
        owners[name] = rank
        load[rank] += size
    return owners


class RingPlanError(BadInput):
    """The members cannot each serve their blobs where their peers reach them."""


def shared_listen_addresses(members: Sequence[PlannedMember]) -> None:
    """Refuse two members serving on one address: the second server could not bind it, and a
    peer could not tell them apart (members on one host need links of their own)."""
    seen: dict[str, PlannedMember] = {}
    for member in members:
        for address in member.listen:
            if address in seen:
                first = seen[address]
                raise RingPlanError(
                    f"members.{member.rank} ({member.node}) would serve on {address} as"
                    f" members.{first.rank} ({first.node}) does; expected an address of its own"
                    " (members on one host: give each its links)"
                )
            seen[address] = member


def plan_ring(
    model: str,
    source: str,
    lock_sha256: str,
    entries: Sequence[tuple[str, int, str]],
    nodes: Sequence[RingNode],
    port: int,
    peer_wait_s: float = 1800.0,
) -> RingPlan:
    """The plan for entries (name, size, sha256) over the ring's members, in rank order."""
    adjacent = neighbours(nodes)
    linked = any(n.links for n in nodes)
    distances = [hops(adjacent, rank) for rank in range(len(nodes))]
    owners = assign_owners([(name, size) for name, size, _ in entries], len(nodes))
    files = []
    for name, size, sha in sorted(entries, key=lambda e: (-e[1], e[0])):
        owner = owners[name]
        routes = tuple(
            (S3,)
            if rank == owner
            else (*sorted(adjacent[rank], key=lambda p: (distances[owner][p], p)), S3)
            for rank in range(len(nodes))
        )
        files.append(PlannedFile(name, size, sha, owner, routes))
    members = []
    for rank, node in enumerate(nodes):
        peers = adjacent[rank]
        if linked:
            reach = {p: nodes[p].links[node.node] for p in peers}
            via = {p: node.links[nodes[p].node] for p in peers}
            listen = tuple(node.links[nodes[p].node] for p in peers)
            allow = tuple(nodes[p].links[node.node] for p in peers)
        else:
            reach = {p: nodes[p].address for p in peers}
            via = {p: node.address for p in peers}
            listen = (node.address,)
            allow = tuple(nodes[p].address for p in peers)
        members.append(PlannedMember(rank, node.node, listen, allow, reach, via))
    shared_listen_addresses(members)
    over = "links" if linked else "management"
    return RingPlan(
        model, source, lock_sha256, port, over, tuple(members), tuple(files), peer_wait_s
    )


def plan_json(plan: RingPlan) -> str:
    """The plan as the JSON document every member is given."""
    return json.dumps(asdict(plan), indent=1, sort_keys=True) + "\n"


def load_plan(text: str) -> RingPlan:
    """A plan back from plan_json's text."""
    data = json.loads(text)
    members = tuple(
        PlannedMember(
            m["rank"],
            m["node"],
            tuple(m["listen"]),
            tuple(m["allow"]),
            {int(k): v for k, v in m["reach"].items()},
            {int(k): v for k, v in m["via"].items()},
        )
        for m in data["members"]
    )
    files = tuple(
        PlannedFile(
            f["name"], f["size"], f["sha256"], f["owner"], tuple(tuple(r) for r in f["routes"])
        )
        for f in data["files"]
    )
    return RingPlan(
        data["model"],
        data["source"],
        data["lock_sha256"],
        data["port"],
        data["over"],
        members,
        files,
        data["peer_wait_s"],
    )


def describe_plan(plan: RingPlan) -> str:
    """The plan as `doit plan_weights` prints it: a line per member, then a row per file."""
    nodes = [m.node for m in plan.members]
    total = sum(f.size for f in plan.files)
    over = (
        "over the ring's links"
        if plan.over == "links"
        else "over management addresses (the profile names no ring links)"
    )
    lines = [
        f"plan_weights: {plan.model}, {len(plan.files)} files, {gb(total)},"
        f" {len(nodes)} members {over}, blob servers on port {plan.port}",
        f"S3 serves {gb(total)} once (each member from S3: {gb(total * len(nodes))})",
        "",
        f"{'member':<16} {'from S3':>22}   from peers",
    ]
    for m in plan.members:
        own = plan.from_s3(m.rank)
        got: dict[int, int] = {}
        for f in plan.from_peers(m.rank):
            first = f.routes[m.rank][0]
            got[first] = got.get(first, 0) + f.size
        peers = ", ".join(f"{nodes[p]} {gb(b)}" for p, b in sorted(got.items()))
        lines.append(
            f"{m.rank} {m.node:<14} {len(own):>4} files {gb(sum(f.size for f in own)):>11}"
            f"   {peers or '-'}"
        )
    lines += ["", f"{'file':<36} {'size':>10}  " + "  ".join(f"{n:<12}" for n in nodes)]
    for f in plan.files:
        cells = [
            "S3" if f.owner == rank else "<- " + nodes[f.routes[rank][0]]
            for rank in range(len(nodes))
        ]
        lines.append(f"{f.name:<36} {gb(f.size):>10}  " + "  ".join(f"{c:<12}" for c in cells))
    return "\n".join(lines)


def gb(n: int) -> str:
    """Bytes in GB (decimal, as the model's sizes are quoted), MB below one GB."""
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"
