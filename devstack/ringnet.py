"""A simulated ring in network namespaces: members in a full mesh, each with a shaped S3 uplink.

As a ring of DGX Sparks sees its storage: every member reaches one S3 server (SeaweedFS, in a
namespace of its own) over its own uplink, whose download direction is shaped with htb at the
server's end, and every two members share a direct link (for three, the switchless triangle).
The host reaches the server over an unshaped management link, to upload. Uplinks and the
management link use 10.253.0.0/16, ring links 10.254.0.0/16, only inside what this module made;
every process started in its namespaces, the namespaces, the veths and the data are removed on
the way out, however it is left (an exception, Ctrl-C, SIGTERM).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from devstack.netns import (
    PRIVATE_TMP,
    LinkError,
    bits_per_second,
    check_free,
    ip,
    shape,
    signals_held,
    sigterm_raises,
    tx_bytes,
    wait_for_bucket,
    weed_argv,
)

if TYPE_CHECKING:
    from types_boto3_s3 import S3Client

UPLINKS = "10.253.0.0/16"
RING_LINKS = "10.254.0.0/16"
# The management link: the host's end, the server's end (the address weed announces).
MANAGEMENT = ("10.253.0.1", "10.253.0.2")
S3_PORT = 8333
MAX_SIZE = 64  # ring link a-b is 10.254.a.(4b)/30, so b < 64


@dataclass(frozen=True)
class RingHost:
    """One member: its namespace, where it reaches S3, and its address and its peer's per link."""

    rank: int
    namespace: str
    s3_endpoint: str
    # peer rank -> (this member's address on the link to it, the peer's address on that link)
    links: dict[int, tuple[str, str]]


@dataclass(frozen=True)
class RingNet:
    """The ring as made: endpoints, members, and the processes started in it (killed at exit)."""

    tag: str
    host_endpoint: str
    s3_namespace: str
    members: list[RingHost]
    uplink_rate: str
    link_rate: str | None
    data: Path
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list, repr=False)

    def popen(
        self, rank: int, argv: Sequence[str], env: Mapping[str, str] | None = None, **kwargs: Any
    ) -> subprocess.Popen[bytes]:
        """Start argv in member rank's namespace, in a session of its own (killpg it)."""
        command = [shutil.which("ip") or "ip", "netns", "exec", self.members[rank].namespace]
        process = subprocess.Popen([*command, *argv], env=env, start_new_session=True, **kwargs)
        self.processes.append(process)
        return process

    def host_s3(self, credentials: Mapping[str, str]) -> S3Client:
        """A boto3 client for the ring's S3 from the host (over management: not counted)."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.host_endpoint,
            region_name="us-east-1",
            aws_access_key_id=credentials["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=credentials["AWS_SECRET_ACCESS_KEY"],
        )

    def s3_bytes_served(self) -> int:
        """Bytes the server's namespace has sent over the member uplinks (not management)."""
        sent = tx_bytes(self.s3_namespace)
        return sum(sent[uplink_device(self.tag, m.rank, "s")] for m in self.members)

    def link_bytes(self) -> dict[tuple[int, int], int]:
        """Bytes each member a has sent to each peer b over their ring link, by (a, b)."""
        counts = {}
        for member in self.members:
            sent = tx_bytes(member.namespace)
            for peer in member.links:
                counts[member.rank, peer] = sent[ring_device(self.tag, member.rank, peer)]
        return counts


def default_scratch() -> Path:
    """Where rings keep their data: /var/tmp, not the stack's folder (0700: the members' blob
    servers, whose workers run as nobody, could not enter it) nor /tmp (the S3 server's
    private /tmp would hide it)."""
    return Path("/var/tmp/sparkforge-ringnet")


def refused_here(err: LinkError) -> bool:
    """True when the error says this host lets nobody make network namespaces (no NET_ADMIN)."""
    text = str(err)
    return "netns add" in text and ("not permitted" in text or "denied" in text)


def uplink_device(tag: str, rank: int, end: str) -> str:
    """Member rank's uplink veth end: "s" the one in the server's namespace, "m" in its own."""
    return f"{tag}u{rank}{end}"


def ring_device(tag: str, rank: int, peer: str | int) -> str:
    """Member rank's veth end on its link to peer."""
    return f"{tag}p{rank}p{peer}"


def uplink_addresses(rank: int) -> tuple[str, str]:
    """(server, member) addresses of member rank's uplink: 10.253.(rank+1).0/30."""
    return f"10.253.{rank + 1}.1", f"10.253.{rank + 1}.2"


def ring_addresses(a: int, b: int) -> tuple[str, str]:
    """(a's, b's) addresses on the link between members a < b: 10.254.a.(4b)/30."""
    return f"10.254.{a}.{4 * b + 1}", f"10.254.{a}.{4 * b + 2}"


@contextlib.contextmanager
def ring_network(
    size: int,
    uplink_rate: str,
    credentials: Mapping[str, str],
    scratch: Path,
    link_rate: str | None = None,
) -> Iterator[RingNet]:
    """size members in a full mesh (links shaped to link_rate if given), S3 at uplink_rate each."""
    if not 1 <= size <= MAX_SIZE:
        raise LinkError(f"ring of {size}: from 1 to {MAX_SIZE} members")
    bits_per_second(uplink_rate)
    if link_rate is not None:
        bits_per_second(link_rate)
    check_free(UPLINKS, RING_LINKS)
    scratch = Path(scratch).resolve()
    if scratch.is_relative_to("/tmp"):
        raise LinkError(f"{scratch}: the ring's S3 data must live outside /tmp (PRIVATE_TMP)")
    tag = f"rn{os.getpid() % 100000}"
    s3_namespace = f"{tag}-s3"
    namespaces = [f"{tag}-m{rank}" for rank in range(size)]
    host_end = f"{tag}mh"
    scratch.mkdir(parents=True, exist_ok=True)
    data = Path(tempfile.mkdtemp(prefix="ringnet-", dir=scratch))
    data.chmod(0o711)  # the members' nginx workers (nobody) enter it; nobody lists it
    made: list[str] = []
    net = None
    with sigterm_raises():
        try:
            for namespace in [s3_namespace, *namespaces]:
                ip("ip", "netns", "add", namespace)
                made.append(namespace)
                ip("ip", "-n", namespace, "link", "set", "lo", "up")
            # Both ends of a pair are made straight in their namespaces: nothing is left on the
            # host by a failure in between, and deleting a namespace takes its pairs along.
            veth(host_end, None, f"{tag}ms", s3_namespace)
            address(host_end, None, MANAGEMENT[0])
            address(f"{tag}ms", s3_namespace, MANAGEMENT[1])
            members = []
            for rank, namespace in enumerate(namespaces):
                server_end = uplink_device(tag, rank, "s")
                member_end = uplink_device(tag, rank, "m")
                server_address, member_address = uplink_addresses(rank)
                veth(server_end, s3_namespace, member_end, namespace)
                address(server_end, s3_namespace, server_address)
                address(member_end, namespace, member_address)
                shape(server_end, s3_namespace, uplink_rate)  # the server's replies: downloads
                members.append(
                    RingHost(rank, namespace, f"http://{server_address}:{S3_PORT}", links={})
                )
            for a in range(size):
                for b in range(a + 1, size):
                    a_end, b_end = ring_device(tag, a, b), ring_device(tag, b, a)
                    a_address, b_address = ring_addresses(a, b)
                    veth(a_end, namespaces[a], b_end, namespaces[b])
                    address(a_end, namespaces[a], a_address)
                    address(b_end, namespaces[b], b_address)
                    if link_rate is not None:
                        shape(a_end, namespaces[a], link_rate)
                        shape(b_end, namespaces[b], link_rate)
                    members[a].links[b] = (a_address, b_address)
                    members[b].links[a] = (b_address, a_address)
            net = RingNet(
                tag=tag,
                host_endpoint=f"http://{MANAGEMENT[1]}:{S3_PORT}",
                s3_namespace=s3_namespace,
                members=members,
                uplink_rate=uplink_rate,
                link_rate=link_rate,
                data=data,
            )
            start_weed(net, credentials)
            yield net
        finally:
            with signals_held():
                if net is not None:
                    stop(net.processes)
                for namespace in made:
                    kill_all_in(namespace)
                    subprocess.run(["ip", "netns", "del", namespace], check=False)
                subprocess.run(
                    ["ip", "link", "del", host_end], check=False, stderr=subprocess.DEVNULL
                )
                shutil.rmtree(data, ignore_errors=True)


def veth(end: str, namespace: str | None, peer: str, peer_namespace: str) -> None:
    """A veth pair, end in namespace (None: the host's), peer in peer_namespace, both up."""
    where = ["netns", namespace] if namespace else []
    ip("ip", "link", "add", end, *where, "type", "veth", "peer", "name", peer,
       "netns", peer_namespace)  # fmt: skip
    ip("ip", *(["-n", namespace] if namespace else []), "link", "set", end, "up")
    ip("ip", "-n", peer_namespace, "link", "set", peer, "up")


def address(device: str, namespace: str | None, host: str) -> None:
    """host/30 on device in namespace (None: the host's)."""
    ip("ip", *(["-n", namespace] if namespace else []), "addr", "add", f"{host}/30", "dev", device)


def start_weed(net: RingNet, credentials: Mapping[str, str]) -> None:
    """`weed mini` in the server's namespace, on all its addresses; until the bucket answers."""
    weed = str(Path(sys.executable).parent / "weed")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")} | dict(credentials)
    log = net.data / "weed.log"
    (net.data / "s3").mkdir()
    argv = weed_argv(weed, net.data / "s3", MANAGEMENT[1], "0.0.0.0", S3_PORT)
    with open(log, "wb") as out:
        server = subprocess.Popen(
            ["ip", "netns", "exec", net.s3_namespace, "sh", "-c", PRIVATE_TMP, "weed-in-netns",
             *argv],
            env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    net.processes.append(server)
    wait_for_bucket(net.host_endpoint, credentials, log)


def stop(processes: list[subprocess.Popen[bytes]], grace_s: float = 10) -> None:
    """SIGTERM to each process group, SIGKILL to those still there after grace_s in all."""
    for process in processes:
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for process in processes:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def kill_all_in(namespace: str) -> None:
    """SIGKILL whatever still runs in namespace (children that left their session)."""
    pids = subprocess.run(
        ["ip", "netns", "pids", namespace], capture_output=True, text=True, check=False
    ).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)
