"""Ring staging: the plan (pure), the blob server's refusals, `doit plan_weights`, and three
members in network namespaces staging the model from one S3 over shaped uplinks."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pwd
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import ringrun
import urllib3
from support.doit import run_doit

from devstack.netns import LinkError
from devstack.ringnet import RingNet, default_scratch, refused_here, ring_network
from pipelines.core.modellock import Lock, LockEntry, load_lock
from pipelines.core.profiles import ProfileError, parse_profile
from pipelines.engine.statcache import StatCache
from pipelines.stages.weights.blobs import BlobStore
from pipelines.stages.weights.blobserver import BlobServer, BlobServerError
from pipelines.stages.weights.ringplan import (
    S3,
    RingNode,
    RingPlanError,
    describe_plan,
    load_plan,
    plan_json,
    plan_ring,
)
from pipelines.stages.weights.s3 import S3Url
from pipelines.stages.weights.sources import NotServed, PeerSource
from pipelines.stages.weights.synthetic import SyntheticShape, upload_synthetic

REPO = Path(__file__).resolve().parent.parent
GB = 10**9


def model_entries() -> list[tuple[str, int, str]]:
    """The real model's shape: 54 files, two 101 GB Engram shards, ~460 GB in all."""
    sizes = {f"model-{i:05d}-of-00048.safetensors": 5_600_000_000 for i in range(1, 47)}
    sizes |= {"model-00047-of-00048.safetensors": 101 * GB}
    sizes |= {"model-00048-of-00048.safetensors": 101 * GB}
    sizes |= {name: 20_000 for name in ("config.json", "tokenizer.json", "MD5SUMS.body")}
    sizes |= {n: 9_000 for n in ("quantization_config.json", "tokenizer_config.json")}
    sizes |= {"model.safetensors.index.json": 120_000}
    return [(n, s, hashlib.sha256(n.encode()).hexdigest()) for n, s in sorted(sizes.items())]


def triangle() -> list[RingNode]:
    """Three members, each pair on its own direct link (a switchless ring of three)."""
    return [
        RingNode("spark-1", "192.168.100.11", {"spark-2": "10.0.12.1", "spark-3": "10.0.13.1"}),
        RingNode("spark-2", "192.168.100.12", {"spark-1": "10.0.12.2", "spark-3": "10.0.23.2"}),
        RingNode("spark-3", "192.168.100.13", {"spark-1": "10.0.13.3", "spark-2": "10.0.23.3"}),
    ]


def square() -> list[RingNode]:
    """Four members cabled in a cycle 1-2-3-4-1: 1 and 3 (2 and 4) share no link."""
    links = {
        "spark-1": {"spark-2": "10.0.12.1", "spark-4": "10.0.41.1"},
        "spark-2": {"spark-1": "10.0.12.2", "spark-3": "10.0.23.2"},
        "spark-3": {"spark-2": "10.0.23.3", "spark-4": "10.0.34.3"},
        "spark-4": {"spark-3": "10.0.34.4", "spark-1": "10.0.41.4"},
    }
    return [RingNode(n, f"192.168.100.2{i}", links[n]) for i, n in enumerate(links, 1)]


def test_each_file_comes_from_s3_once_and_the_owners_share_the_bytes_evenly():
    entries = model_entries()
    plan = plan_ring("m", "s3://b/m", "0" * 64, entries, triangle(), 8098)
    assert sorted(f.name for f in plan.files) == sorted(n for n, _, _ in entries)
    owned = [sum(f.size for f in plan.from_s3(rank)) for rank in range(3)]
    assert sum(owned) == sum(s for _, s, _ in entries)  # one model from S3, not three
    # Biggest first to the least loaded: no member owns more than a third plus one file.
    assert max(owned) - min(owned) <= 5_600_000_000
    engram = [f.owner for f in plan.files if f.size == 101 * GB]
    assert sorted(engram) == [0, 1]  # the two 101 GB shards go to different members
    for f in plan.files:
        assert f.routes[f.owner] == (S3,)
        for rank, route in enumerate(f.routes):
            if rank != f.owner:
                assert route[0] == f.owner and route[-1] == S3  # owner first, S3 last


def test_a_member_fetches_only_from_linked_neighbours_nearest_the_owner_first():
    plan = plan_ring("m", "s3://b/m", "0" * 64, model_entries(), square(), 8098)
    for f in plan.files:
        opposite = (f.owner + 2) % 4
        for rank in ((f.owner + 1) % 4, (f.owner + 3) % 4):
            assert f.routes[rank][0] == f.owner  # the owner's neighbours take it from the owner
        # The member opposite the owner has no link to it: it asks its two neighbours.
        assert f.owner not in f.routes[opposite]
        assert sorted(f.routes[opposite][:2]) == sorted({(f.owner + 1) % 4, (f.owner + 3) % 4})
    spark1 = plan.members[0]
    assert spark1.reach == {1: "10.0.12.2", 3: "10.0.41.4"}  # peers' ends of its two links
    assert spark1.listen == ("10.0.12.1", "10.0.41.1")
    assert spark1.allow == ("10.0.12.2", "10.0.41.4")


def test_without_links_members_serve_and_reach_each_other_at_management_addresses():
    nodes = [RingNode(n.node, n.address, {}) for n in triangle()]
    plan = plan_ring("m", "s3://b/m", "0" * 64, model_entries(), nodes, 8098)
    assert plan.over == "management"
    assert plan.members[1].listen == ("192.168.100.12",)
    assert plan.members[1].allow == ("192.168.100.11", "192.168.100.13")
    assert plan.members[1].reach == {0: "192.168.100.11", 2: "192.168.100.13"}


def test_two_members_that_would_serve_on_one_address_are_refused_naming_both():
    # The shipped local-ring: two engines on this machine, both at 127.0.0.1, no links.
    nodes = [RingNode("ring-a", "127.0.0.1", {}), RingNode("ring-b", "127.0.0.1", {})]
    with pytest.raises(RingPlanError) as err:
        plan_ring("m", "s3://b/m", "0" * 64, model_entries(), nodes, 8098)
    assert str(err.value) == (
        "members.1 (ring-b) would serve on 127.0.0.1 as members.0 (ring-a) does; expected an"
        " address of its own (members on one host: give each its links)"
    )
    linked = [RingNode("ring-a", "127.0.0.1", {"ring-b": "127.0.0.2"}),
              RingNode("ring-b", "127.0.0.1", {"ring-a": "127.0.0.3"})]  # fmt: skip
    plan = plan_ring("m", "s3://b/m", "0" * 64, model_entries(), linked, 8098)
    assert [m.listen for m in plan.members] == [("127.0.0.2",), ("127.0.0.3",)]


def test_plan_is_a_pure_function_and_survives_its_json():
    one = plan_ring("m", "s3://b/m", "0" * 64, model_entries(), triangle(), 8098)
    two = plan_ring("m", "s3://b/m", "0" * 64, list(reversed(model_entries())), triangle(), 8098)
    assert one == two
    assert load_plan(plan_json(one)) == one
    text = describe_plan(one).splitlines()
    assert text[1] == "S3 serves 459.6 GB once (each member from S3: 1378.8 GB)"
    assert text[4].split() == ["0", "spark-1", "11", "files", "151.4", "GB", "spark-2", "151.4",
                               "GB,", "spark-3", "156.8", "GB"]  # fmt: skip


PROFILE_HEAD = """\
name: {name}
description: A simulated ring of three on this machine.
runtime: simulated
deploy: docker
local_stack: true
image: local-sim
model:
  lock: dsv41-flash-synthetic
  source: s3://models/sparkforge/DeepSeek-V4.1-Flash-synthetic
  served_name: DeepSeek-V4.1-Flash-EXL3
  format: safetensors
  quantization: exl3
  config_patch: tp3-heads
parallel: {{tensor: 3, pipeline: 1}}
resources: {{gpu: 1, memory: 2Gi, cpu: "1"}}
simulator:
  {{port: 8000, max_model_len: 8192, max_running_requests: 4, ttft_s: 0.1, decode_tok_s: 100}}
members:
"""


def ring_profile(folder: Path, name: str, members: str) -> Path:
    """A three-member simulated ring profile with the given members block."""
    path = folder / f"{name}.yaml"
    path.write_text(PROFILE_HEAD.format(name=name) + members)
    return path


TRIANGLE_MEMBERS = """\
  - {node: m0, address: 127.0.0.1, socket_interface: lo, links: {m1: 10.0.1.1, m2: 10.0.2.1}}
  - {node: m1, address: 127.0.0.1, socket_interface: lo, links: {m0: 10.0.1.2, m2: 10.0.3.2}}
  - {node: m2, address: 127.0.0.1, socket_interface: lo, links: {m0: 10.0.2.3, m1: 10.0.3.3}}
"""


@pytest.mark.parametrize(
    ("members", "error"),
    [
        (
            TRIANGLE_MEMBERS.replace("m2: 10.0.3.2", "m9: 10.0.3.2"),
            "field 'members.1.links.m9': expected another member's node (one of m0, m2)",
        ),
        (
            TRIANGLE_MEMBERS.replace(", m1: 10.0.3.3", ""),
            "field 'members.2.links': expected 'm1', the other end of members.1.links.m2",
        ),
        (
            TRIANGLE_MEMBERS.replace("links: {m0: 10.0.2.3, m1: 10.0.3.3}", "claim: x"),
            "field 'members.2.links': required once any member names its links",
        ),
        (
            TRIANGLE_MEMBERS.replace("10.0.1.1", "10.0.1.300"),
            "members",
        ),
    ],
)
def test_links_that_do_not_join_the_ring_are_refused_naming_the_field(tmp_path, members, error):
    path = ring_profile(tmp_path, "ring", members)
    with pytest.raises(ProfileError) as err:
        parse_profile(path)
    assert error in str(err.value)
    assert str(path) in str(err.value)


def test_doit_plan_weights_prints_who_fetches_what_from_where(tmp_path, stack_env):
    ring_profile(tmp_path, "ring3", TRIANGLE_MEMBERS)
    env = {**os.environ, **stack_env, "SPARKFORGE_PROFILES": str(tmp_path)}
    env["SPARKFORGE_STORE"] = str(tmp_path / "store")
    done = run_doit("plan_weights", "profile=ring3", env=env)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "54 files, 98.6 MB, 3 members over the ring's links" in out
    assert "S3 serves 98.6 MB once (each member from S3: 295.8 MB)" in out
    rows = {row.split()[0]: row.split()[2:] for row in out.splitlines() if ".safetensors" in row}
    big = rows["model-00047-of-00048.safetensors"]
    assert big.count("S3") == 1 and big.count("<-") == 2  # one member from S3, two from it


@pytest.fixture
def served_tmp():
    """A folder the blob server's workers may enter: they run as nobody when the store is
    root's, and pytest's tmp_path is 0700. Search only (0711): nobody lists it."""
    folder = Path(tempfile.mkdtemp(dir="/var/tmp"))
    folder.chmod(0o711)
    yield folder
    shutil.rmtree(folder)


def test_blob_server_serves_ranges_to_ring_addresses_and_refuses_everyone_else(served_tmp):
    blobs, ring = served_tmp / "blobs", served_tmp / "ring"
    blobs.mkdir()
    data = os.urandom(100_000)
    sha = hashlib.sha256(data).hexdigest()
    (blobs / sha).write_bytes(data)
    (served_tmp / "partial.part").write_bytes(data)
    server = BlobServer(blobs, ring, ("127.0.0.2",), ("127.0.0.3",), 18397).start()
    try:
        peer = urllib3.PoolManager(source_address=("127.0.0.3", 0), retries=False)
        stranger = urllib3.PoolManager(source_address=("127.0.0.4", 0), retries=False)
        url = f"http://127.0.0.2:18397/sha256/{sha}"
        got = peer.request("GET", url, headers={"Range": "bytes=1000-1999"})
        assert (got.status, got.headers["Content-Range"]) == (206, "bytes 1000-1999/100000")
        assert got.data == data[1000:2000]
        assert stranger.request("GET", url).status == 403
        assert peer.request("PUT", url, body=b"x").status == 403
        assert peer.request("DELETE", url).status == 403
        assert peer.request("GET", "http://127.0.0.2:18397/partial.part").status == 404
        assert peer.request("GET", f"http://127.0.0.2:18397/sha256/{'0' * 64}").status == 404
    finally:
        pid = server.process.pid
        server.stop()
    assert not Path(f"/proc/{pid}").exists()


UNNAMED_ID = 54321  # a host uid and gid with no passwd or group entry here


@pytest.fixture
def unnamed_root():
    """A weights folder owned by an id this machine has no name for, in a folder others may
    enter (pytest's tmp_path is 0700: the stager's claim is not)."""
    if os.geteuid() != 0:
        pytest.skip("chown to another uid needs root")
    with pytest.raises(KeyError):
        pwd.getpwuid(UNNAMED_ID)
    parent = Path(tempfile.mkdtemp(dir="/var/tmp"))
    parent.chmod(0o755)
    root = parent / "weights"
    (root / "blobs").mkdir(parents=True)
    for folder in (root, root / "blobs"):
        os.chown(folder, UNNAMED_ID, UNNAMED_ID)
    yield root
    shutil.rmtree(parent)


def test_a_weights_folder_owned_by_an_unnamed_uid_is_served(unnamed_root):
    root = unnamed_root
    data = os.urandom(10_000)
    sha = hashlib.sha256(data).hexdigest()
    (root / "blobs" / sha).write_bytes(data)
    (root / "blobs" / sha).chmod(0o444)  # as the blob store publishes it
    server = BlobServer(root / "blobs", root / "ring", ("127.0.0.2",), ("127.0.0.3",), 18399)
    server.start()
    try:
        peer = urllib3.PoolManager(source_address=("127.0.0.3", 0), retries=False)
        got = peer.request("GET", f"http://127.0.0.2:18399/sha256/{sha}")
        assert (got.status, got.data) == (200, data)
    finally:
        server.stop()


def test_an_unnamed_owner_whose_folder_nobody_may_enter_is_one_line(unnamed_root):
    unnamed_root.chmod(0o700)
    with pytest.raises(BlobServerError) as err:
        BlobServer(unnamed_root / "blobs", unnamed_root / "ring", ("127.0.0.2",), (), 18399)
    assert str(err.value) == (
        f"{unnamed_root / 'blobs'}: owner uid {UNNAMED_ID} has no passwd entry, so nginx serves"
        f" it as nobody, which may not enter {unnamed_root} (drwx------)"
    )


def raw_get(path: str, port: int, source: str = "127.0.0.3") -> tuple[int, bytes]:
    """GET path from 127.0.0.2 as sent, byte for byte: HTTP clients normalize dot segments."""
    with socket.create_connection(("127.0.0.2", port), 5, (source, 0)) as conn:
        conn.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        answer = b"".join(iter(lambda: conn.recv(65536), b""))
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


@pytest.mark.parametrize(
    "path",
    [
        "/sha256/../ring/status.json",
        "/sha256/%2e%2e/ring/status.json",
        "/sha256/%2E%2E%2Fring%2Fstatus.json",
        "/sha256/..%2fsecret",
        "/sha256/./../secret",
        "/ring/status.json",
        "/secret",
    ],
)
def test_paths_outside_the_blobs_are_refused_however_they_are_spelled(served_tmp, path):
    blobs, ring = served_tmp / "blobs", served_tmp / "ring"
    blobs.mkdir()
    ring.mkdir()
    (ring / "status.json").write_text('{"secret": "in the ring folder"}')
    (served_tmp / "secret").write_text("beside the blobs")
    server = BlobServer(blobs, ring, ("127.0.0.2",), ("127.0.0.3",), 18396).start()
    try:
        status, body = raw_get(path, 18396)
        assert status in (400, 403, 404) and b"secret" not in body, (status, body)
        assert raw_get("/status.json", 18396)[0] == 200  # the one file outside it is there
    finally:
        server.stop()


def test_a_link_in_the_blob_folder_is_not_served_whatever_it_points_at(served_tmp):
    blobs, ring = served_tmp / "blobs", served_tmp / "ring"
    blobs.mkdir()
    outside = served_tmp / "outside"
    outside.write_bytes(b"not a blob")
    data = os.urandom(1000)
    sha = hashlib.sha256(data).hexdigest()
    (blobs / sha).write_bytes(data)
    linked = hashlib.sha256(b"not a blob").hexdigest()
    (blobs / linked).symlink_to(outside)
    server = BlobServer(blobs, ring, ("127.0.0.2",), ("127.0.0.3",), 18395).start()
    try:
        assert raw_get(f"/sha256/{sha}", 18395) == (200, data)  # the file beside it is served
        status, body = raw_get(f"/sha256/{linked}", 18395)
        assert status == 403 and b"not a blob" not in body
    finally:
        server.stop()


def test_a_peer_blob_of_another_size_is_not_served_to_the_fetch(served_tmp):
    blobs, ring = served_tmp / "blobs", served_tmp / "ring"
    blobs.mkdir()
    data = os.urandom(50_000)
    sha = hashlib.sha256(data).hexdigest()
    (blobs / sha).write_bytes(data[:40_000])  # cut short on the peer's disk
    server = BlobServer(blobs, ring, ("127.0.0.2",), ("127.0.0.3",), 18398).start()
    try:
        pool = urllib3.PoolManager(source_address=("127.0.0.3", 0))
        peer = PeerSource(pool, "http://127.0.0.2:18398", "m1")
        entry = LockEntry(name="f", size=len(data), sha256=sha)
        view = memoryview(bytearray(1000))
        with pytest.raises(NotServed) as err:  # any range of it: its size is not the lock's
            peer.read(entry, 1000, view, threading.Event(), lambda n: None, None)
        assert str(err.value) == (
            "f from m1: HTTP 206 Content-Range 'bytes 1000-1999/40000', expected"
            " 'bytes 1000-1999/50000'"
        )
        (blobs / sha).unlink()
        (blobs / sha).write_bytes(data)
        peer.read(entry, 1000, view, threading.Event(), lambda n: None, None)
        assert bytes(view) == data[1000:2000]
        entry_gone = LockEntry(name="g", size=10, sha256="1" * 64)
        with pytest.raises(NotServed, match="g from m1: HTTP 404"):
            peer.read(entry_gone, 0, memoryview(bytearray(10)), threading.Event(), print, None)
    finally:
        server.stop()


# --- a ring of three network namespaces (devstack/ringnet.py) -----------------------------------

UPLINK = "200mbit"  # each member's path to S3: the scarce link
LINK = "400mbit"  # between members: faster, and slow enough to kill a member mid-way
SYNTHETIC = REPO / "weights" / "dsv41-flash-synthetic.lock.yaml"
BIG = "model-00047-of-00048.safetensors"


@dataclass
class Ring:
    """The namespaces, the model in their S3, and the plan every member gets."""

    net: RingNet
    credentials: dict[str, str]
    lock: Lock
    plan_file: Path
    work: Path

    @property
    def model_bytes(self) -> int:
        """Bytes in one copy of the model."""
        return sum(e.size for e in self.lock.files)


@pytest.fixture(scope="module")
def ring():
    """Three members, each behind its own shaped uplink to S3, on a triangle of links."""
    credentials = {
        "AWS_ACCESS_KEY_ID": secrets.token_hex(10),
        "AWS_SECRET_ACCESS_KEY": secrets.token_hex(20),
    }
    scratch = default_scratch()
    with contextlib.ExitStack() as stack:
        try:
            net = stack.enter_context(ring_network(3, UPLINK, credentials, scratch, LINK))
        except LinkError as err:
            if refused_here(err):
                pytest.skip(f"no network namespaces here (CAP_NET_ADMIN): {err}")
            raise
        lock = load_lock(SYNTHETIC)
        host = net.host_s3(credentials)
        upload_synthetic(host, lock.source, SyntheticShape())
        work = net.data / "staging"
        work.mkdir()
        plan_file = work / "plan.json"
        ringrun.write_plan(net, lock, plan_file)
        yield Ring(net, credentials, lock, plan_file, work)


def start_member(
    ring: Ring, rank: int, root: Path, log: Path, peer_wait_s: float = 60
) -> subprocess.Popen:
    """The ring member (stages/weights/ring.py) for rank, in its namespace, S3 on its uplink."""
    return ringrun.start_member(
        ring.net, rank, ring.credentials, ring.plan_file, root, log,
        part_mib=4, peer_wait_s=peer_wait_s, interval=1,
    )  # fmt: skip


def finish(processes: dict[int, subprocess.Popen], logs: dict[int, Path], timeout: float = 120):
    """Wait for every member; a failure shows its log."""
    for rank, process in processes.items():
        rc = process.wait(timeout=timeout)
        assert rc == 0, f"member {rank} exited {rc}:\n{logs[rank].read_text()[-3000:]}"


def assert_only_right_blobs(root: Path, lock: Lock) -> None:
    """Every locked file is a blob, and every blob's bytes hash to its name."""
    blobs = root / "blobs" / "sha256"
    for blob in blobs.iterdir():
        assert hashlib.sha256(blob.read_bytes()).hexdigest() == blob.name, f"wrong blob {blob}"
    assert {e.sha256 for e in lock.files} <= {b.name for b in blobs.iterdir()}


def roots_and_logs(ring: Ring, name: str) -> tuple[dict[int, Path], dict[int, Path]]:
    """A fresh weights folder and log file per member for one test."""
    folder = ring.work / name
    folder.mkdir()
    return {r: folder / f"m{r}" for r in range(3)}, {r: folder / f"m{r}.log" for r in range(3)}


def status(root: Path) -> dict:
    """A member's status.json as it last wrote it ({} before it first does)."""
    try:
        return json.loads((root / "ring" / "status.json").read_text())
    except (FileNotFoundError, ValueError):
        return {}


def test_ring_members_end_verified_with_one_model_from_s3(ring):
    roots, logs = roots_and_logs(ring, "once")
    before = ring.net.s3_bytes_served()
    finish({r: start_member(ring, r, roots[r], logs[r]) for r in range(3)}, logs)
    served = ring.net.s3_bytes_served() - before
    for r in range(3):
        assert_only_right_blobs(roots[r], ring.lock)
        final = status(roots[r])
        assert final["complete"] and final["from_peers"] > 0
    # Counted at the server: one model (plus HTTP), not three.
    assert ring.model_bytes <= served < 1.05 * ring.model_bytes, served
    shares = [status(roots[r])["from_s3"] for r in range(3)]
    assert sum(shares) < 1.05 * ring.model_bytes and min(shares) > 0.25 * ring.model_bytes
    text = logs[2].read_text()
    assert re.search(r"stage_ring m2: [\d.]+ MiB / 94\.0 MiB \(\d+%\), [\d.]+ MiB from S3,"
                     r" [\d.]+ MiB from peers, \d+ MB/s, ETA \d:\d\d:\d\d; ring", text)  # fmt: skip
    assert "stage_ring m2: done: 54 files verified" in text


def test_a_file_whose_owner_is_still_fetching_is_waited_for_past_peer_wait(ring):
    # Each owner's share (about 33 MB) takes some 4 s at 64 Mbit/s, far past a peer wait of
    # 1.5 s counted from the start, which would send the others to S3 for its later files.
    roots, logs = roots_and_logs(ring, "patient")
    before = ring.net.s3_bytes_served()
    members = {
        r: ringrun.start_member(
            ring.net,
            r,
            ring.credentials,
            ring.plan_file,
            roots[r],
            logs[r],
            part_mib=1,
            peer_wait_s=1.5,
            interval=1,
            max_mbps=64,
        )  # fmt: skip
        for r in range(3)
    }
    finish(members, logs)
    served = ring.net.s3_bytes_served() - before
    assert ring.model_bytes <= served < 1.05 * ring.model_bytes, served
    for r in range(3):
        assert "fetching from S3" not in logs[r].read_text()


def test_a_member_killed_mid_way_resumes_from_its_peers(ring):
    roots, logs = roots_and_logs(ring, "killed")
    before = ring.net.s3_bytes_served()
    members = {r: start_member(ring, r, roots[r], logs[r]) for r in range(3)}
    deadline = time.monotonic() + 60
    while True:
        while not (status(roots[2]).get("from_peers", 0) > 8 << 20 and partial_bytes(roots[2])):
            assert time.monotonic() < deadline and members[2].poll() is None, logs[2].read_text()
            time.sleep(0.02)
        # Stopped, then looked at: a partial file seen a moment before may have been finished
        # and published since (a loaded machine); killed only while it holds one.
        os.killpg(members[2].pid, signal.SIGSTOP)
        if partial_bytes(roots[2]):
            break
        os.killpg(members[2].pid, signal.SIGCONT)
    os.killpg(members[2].pid, signal.SIGKILL)
    members[2].wait()
    assert not status(roots[2]).get("complete")
    assert_only_right_blobs_so_far(roots[2])
    partial = partial_bytes(roots[2])
    kept = partial + sum(p.stat().st_size for p in (roots[2] / "blobs" / "sha256").iterdir())
    members[2] = start_member(ring, 2, roots[2], logs[2])
    finish(members, logs)
    served = ring.net.s3_bytes_served() - before
    for r in range(3):
        assert_only_right_blobs(roots[r], ring.lock)
    again = status(roots[2])
    # The second run reads back what the first left on disk, downloads only what was missing
    # (ranges in flight at the kill are the only loss), and from its peers.
    assert again["read_back"] == partial > 0
    assert again["from_s3"] + again["from_peers"] <= ring.model_bytes - kept + (16 << 20)
    assert again["from_peers"] > 0
    assert "stage_ring m2: done: 54 files verified" in logs[2].read_text()
    assert served < 1.3 * ring.model_bytes, served


def partial_bytes(root: Path) -> int:
    """Bytes in a member's partial downloads (verified prefixes a restart reads back)."""
    total = 0
    for part in (root / "partial").glob("*.part"):
        with contextlib.suppress(FileNotFoundError):  # published (renamed away) meanwhile
            total += part.stat().st_size
    return total


def assert_only_right_blobs_so_far(root: Path) -> None:
    """Whatever was killed, every published blob hashes to its name."""
    for blob in (root / "blobs" / "sha256").iterdir():
        assert hashlib.sha256(blob.read_bytes()).hexdigest() == blob.name, f"wrong blob {blob}"


def test_a_peer_serving_a_flipped_byte_is_refused_and_the_file_comes_from_another(ring):
    roots, logs = roots_and_logs(ring, "flipped")
    big = ring.lock.entry(BIG)
    assert load_plan(ring.plan_file.read_text()).files[0].owner == 0  # m0 fetches it from S3
    # m1 believes it holds the big shard (its stat cache says so), but one byte rotted on disk.
    blobs = BlobStore(roots[1], StatCache(roots[1] / "statcache.sqlite3"))
    host = ring.net.host_s3(ring.credentials)
    url = S3Url.parse(ring.lock.source)
    data = bytearray(host.get_object(Bucket=url.bucket, Key=url.key(BIG))["Body"].read())
    data[len(data) // 2] ^= 0x01
    rotten = roots[1] / "partial" / "rotten"
    rotten.write_bytes(data)
    blobs.publish(rotten, big.sha256)
    # m2 asks m1 first: m0, the shard's owner and m2's first choice, starts later.
    members = {r: start_member(ring, r, roots[r], logs[r]) for r in (1, 2)}
    deadline = time.monotonic() + 30
    while "refused" not in logs[2].read_text():
        assert time.monotonic() < deadline, logs[2].read_text()
        time.sleep(0.05)
    members[0] = start_member(ring, 0, roots[0], logs[0])
    finish(members, logs)
    text = logs[2].read_text()
    assert (
        f"stage_ring m2: refused {BIG} from m1: {BIG}: sha256 mismatch: expected {big.sha256}"
        in text
    )
    assert "(from m1; not stored); asking another source" in text
    assert text.count(f"refused {BIG} from m1") == 1  # never asked again for it
    assert_only_right_blobs(roots[2], ring.lock)
    assert_only_right_blobs(roots[0], ring.lock)
    assert "done: 54 files verified" in text


def test_a_member_whose_disk_refuses_a_peer_file_fails_it_without_blaming_the_peer(ring):
    roots, logs = roots_and_logs(ring, "full")
    peer_file = load_plan(ring.plan_file.read_text()).from_peers(2)[0]
    part = roots[2] / "partial" / f"{peer_file.sha256}.part"
    part.parent.mkdir(parents=True)
    part.symlink_to("/dev/full")  # every write of that file fails as on a full disk
    members = {r: start_member(ring, r, roots[r], logs[r]) for r in range(3)}
    try:
        assert members[2].wait(timeout=90) == 1, logs[2].read_text()
    finally:
        for rank in (0, 1):  # they would serve on, waiting for m2 to be done
            with contextlib.suppress(ProcessLookupError):
                os.killpg(members[rank].pid, signal.SIGKILL)
            members[rank].wait()
    text = logs[2].read_text()
    assert f"error: {peer_file.name}: writing {part}: No space left on device" in text
    assert "refused" not in text  # the peers served it right: none is refused for it
    assert not status(roots[2]).get("complete")


def test_a_member_s3_refuses_stops_at_once_in_one_line_not_after_peer_wait(ring):
    roots, logs = roots_and_logs(ring, "refused")
    wrong = {**ring.credentials, "AWS_SECRET_ACCESS_KEY": secrets.token_hex(20)}
    member = ringrun.start_member(
        ring.net, 0, wrong, ring.plan_file, roots[0], logs[0],
        part_mib=4, peer_wait_s=600, interval=1,
    )  # fmt: skip
    try:
        assert member.wait(timeout=60) == 1, logs[0].read_text()  # not after 600 s of waiting
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(member.pid, signal.SIGKILL)
        member.wait()
    failures = [
        line for line in logs[0].read_text().splitlines() if "SignatureDoesNotMatch" in line
    ]
    assert len(failures) == 1 and failures[0].startswith("error: S3 endpoint http://")
    assert wrong["AWS_SECRET_ACCESS_KEY"] not in logs[0].read_text()


def stage_beside_a_broken_m2(
    ring: Ring, roots: dict[int, Path], logs: dict[int, Path], peer: list[str], within_s: float
) -> None:
    """Run peer (a script and its arguments, then m2's addresses) in m2's namespace in m2's
    place, and m0 and m1 beside it (peer_wait_s 5): both must be done within within_s."""
    plan = load_plan(ring.plan_file.read_text())
    broken = ring.net.popen(
        2,
        [sys.executable, "-c", *peer, *plan.members[2].listen],
        stdout=subprocess.PIPE,
    )
    members = {}
    try:
        assert broken.stdout.readline() == b"listening\n"
        started = time.monotonic()
        members = {r: start_member(ring, r, roots[r], logs[r], peer_wait_s=5) for r in (0, 1)}
        for rank, process in members.items():
            left = max(within_s - (time.monotonic() - started), 0.1)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=left)
            assert process.returncode == 0, (
                f"member {rank} not done {time.monotonic() - started:.0f} s after start beside"
                f" the broken m2:\n{logs[rank].read_text()[-3000:]}"
            )
    finally:
        for process in [broken, *members.values()]:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()


HUNG_PEER = """\
import socket, sys, time
held = []
for address in sys.argv[2:]:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((address, int(sys.argv[1])))
    s.listen(64)
    held.append(s)
print("listening", flush=True)
time.sleep(3600)  # the kernel accepts every connection; nothing ever answers
"""


def test_a_peer_that_accepts_and_never_answers_stalls_no_other_member(ring):
    roots, logs = roots_and_logs(ring, "hung")
    plan = load_plan(ring.plan_file.read_text())
    # m2 owns a third of the files: after peer_wait_s they come from S3 instead. Unstalled, each
    # finishes in about peer_wait_s (m2's share) + 5 s linger + transfers; a loop blocked on m2's
    # status for a minute per pass would take many minutes.
    stage_beside_a_broken_m2(ring, roots, logs, [HUNG_PEER, str(plan.port)], within_s=60)
    for r in (0, 1):
        assert_only_right_blobs(roots[r], ring.lock)
        assert status(roots[r])["complete"]
        assert "done: 54 files verified" in logs[r].read_text()


# A peer that says it holds every file, then never answers a file's GET, or stops sending in the
# middle of each body.
STALLING_PEER = """\
import json, sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
port, status, sizes, where = int(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]

class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        if self.path == "/status.json":
            body = status.encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        if where == "answer":
            time.sleep(3600)
        size = sizes[self.path.rsplit("/", 1)[1]]
        start, end = map(int, self.headers["Range"].removeprefix("bytes=").split("-"))
        self.send_response(206)
        self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.send_header("Content-Length", str(end - start + 1))
        self.end_headers()
        self.wfile.write(bytes(min(4096, end - start)))
        self.wfile.flush()
        time.sleep(3600)

for address in sys.argv[5:]:
    threading.Thread(target=ThreadingHTTPServer((address, port), Handler).serve_forever).start()
print("listening", flush=True)
"""


@pytest.mark.parametrize(
    ("where", "said"),
    [("answer", "sent no answer for 15 s"), ("body", "sent nothing for 15 s in bytes ")],
)
def test_a_peer_that_stops_sending_is_asked_for_nothing_more(ring, where, said):
    roots, logs = roots_and_logs(ring, f"stalling-{where}")
    plan = load_plan(ring.plan_file.read_text())
    everything = {f.sha256: f.size for f in plan.files}
    claims = {"rank": 2, "node": "m2", "lock_sha256": plan.lock_sha256,
              "published": sorted(everything), "done": 0, "total": sum(everything.values()),
              "from_s3": 0, "from_peers": 0, "complete": False}  # fmt: skip
    # m2's files stall once, for the peer read timeout (15 s), then come from elsewhere; a range
    # retried against m2, or m2 asked for its next file, costs 15 s more each time.
    argv = [STALLING_PEER, str(plan.port), json.dumps(claims), json.dumps(everything), where]
    stage_beside_a_broken_m2(ring, roots, logs, argv, within_s=75)
    for r in (0, 1):
        text = logs[r].read_text()
        assert_only_right_blobs(roots[r], ring.lock)
        assert "done: 54 files verified" in text
        assert f" from m2: {said}" in text, text[-3000:]
        assert text.count("asking m2 for nothing more") == 1, text[-3000:]
