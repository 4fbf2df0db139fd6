"""The simulated ring (devstack/ringnet.py): shaped uplinks counted at the server, a full mesh."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import subprocess
import sys

import pytest

from devstack.netns import LinkError, bits_per_second
from devstack.ringnet import default_scratch, refused_here, ring_network

# SeaweedFS in network namespaces: services, so not the fast lane (conftest.py).
pytestmark = pytest.mark.stack

MiB = 1 << 20
OBJECT_BYTES = 20 * MiB
UPLINK = "200mbit"
PEER_PORT = 8765

# Prints the bytes read and the seconds the GET took, the interpreter's start left out.
DOWNLOAD = """
import sys, time, boto3
client = boto3.client("s3", endpoint_url=sys.argv[1], region_name="us-east-1")
start = time.monotonic()
body = client.get_object(Bucket="models", Key=sys.argv[2])["Body"]
read = 0
while chunk := body.read(1 << 20):
    read += len(chunk)
print(read, time.monotonic() - start)
"""

# Prints {url: body} for each url given, retried while the peer's server is starting.
FETCH = """
import json, sys, time, urllib.request
bodies, deadline = {}, time.monotonic() + 15
for url in sys.argv[1:]:
    while True:
        try:
            bodies[url] = urllib.request.urlopen(url, timeout=2).read().decode()
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
print(json.dumps(bodies))
"""


def child_env(credentials: dict[str, str]) -> dict[str, str]:
    """This environment with only the ring's keys for AWS and no proxy (none is reachable)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("AWS_") and not k.lower().endswith("_proxy")
    }
    return env | credentials


def run_in_members(net, argvs: dict[int, list[str]], env: dict[str, str]) -> dict[int, str]:
    """Each member's command at once; their stdout by rank, any failure raised."""
    started = {
        rank: net.popen(rank, argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for rank, argv in argvs.items()
    }
    outputs = {}
    for rank, process in started.items():
        stdout, stderr = process.communicate(timeout=60)
        assert process.returncode == 0, f"member {rank}: {stderr.decode()[-2000:]}"
        outputs[rank] = stdout.decode()
    return outputs


def test_ring_network_shapes_uplinks_meshes_members_and_leaves_nothing():
    credentials = {
        "AWS_ACCESS_KEY_ID": f"ring-{secrets.token_hex(4)}",
        "AWS_SECRET_ACCESS_KEY": secrets.token_hex(16),
    }
    env = child_env(credentials)
    with contextlib.ExitStack() as stack:
        try:
            net = stack.enter_context(ring_network(3, UPLINK, credentials, default_scratch()))
        except LinkError as err:
            if refused_here(err):
                pytest.skip(f"no network namespaces here (CAP_NET_ADMIN): {err}")
            raise
        host = net.host_s3(credentials)
        # The host's own traffic goes over the management link, which the server does not count.
        served_before = net.s3_bytes_served()
        host.put_object(Bucket="models", Key="blob", Body=os.urandom(OBJECT_BYTES))
        assert len(host.get_object(Bucket="models", Key="blob")["Body"].read()) == OBJECT_BYTES
        host.close()
        assert net.s3_bytes_served() - served_before < MiB

        served_before = net.s3_bytes_served()
        outputs = run_in_members(
            net,
            {m.rank: [sys.executable, "-c", DOWNLOAD, m.s3_endpoint, "blob"] for m in net.members},
            env,
        )
        served = net.s3_bytes_served() - served_before
        for rank, output in outputs.items():
            read, seconds = output.split()
            assert int(read) == OBJECT_BYTES
            rate = OBJECT_BYTES * 8 / float(seconds)
            assert rate < bits_per_second(UPLINK), f"member {rank} downloaded at {rate:.3g} bit/s"
        assert 3 * OBJECT_BYTES <= served < 3.3 * OBJECT_BYTES

        for member in net.members:
            (net.data / f"m{member.rank}").mkdir()
            (net.data / f"m{member.rank}" / "rank").write_text(str(member.rank))
            net.popen(
                member.rank,
                [sys.executable, "-m", "http.server", str(PEER_PORT), "--bind", "0.0.0.0",
                 "--directory", str(net.data / f"m{member.rank}")],
                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
        links_before = net.link_bytes()
        urls = {
            m.rank: {
                peer: f"http://{theirs}:{PEER_PORT}/rank" for peer, (_, theirs) in m.links.items()
            }
            for m in net.members
        }
        outputs = run_in_members(
            net,
            {rank: [sys.executable, "-c", FETCH, *peers.values()] for rank, peers in urls.items()},
            env,
        )
        links = net.link_bytes()
        for rank, peers in urls.items():
            bodies = json.loads(outputs[rank])
            assert {peer: bodies[url] for peer, url in peers.items()} == {
                peer: str(peer) for peer in peers
            }
        assert sorted(links) == [(a, b) for a in range(3) for b in range(3) if a != b]
        assert all(links[pair] > links_before[pair] for pair in links), (links_before, links)

    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    interfaces = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert f"{net.tag}-" not in namespaces
    assert net.tag not in interfaces
    assert all(process.returncode is not None for process in net.processes)
    assert not net.data.exists()
