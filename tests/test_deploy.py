"""`doit deploy` of one member on the local stack, as a user runs it: the simulated runtime in a
container of the stack's engine, `:stable` in the stack's registry (under a namespace of the
tests' own), and what preflight refuses before anything is touched."""

from __future__ import annotations

import copy
import hashlib
import json
import secrets
import subprocess
from pathlib import Path

import docker
import msgspec
import pytest
from support.attestations import vouch_like
from support.deploying import (
    deploy_variant,
    deployed,
    doit,
    member,
    records,
    served_models,
    tag_digest,
)

from pipelines.core.errors import DeployError
from pipelines.core.profiles import load_profile
from pipelines.stages.deploy.docker import Change, DockerHosts
from pipelines.stages.deploy.plan import Deployment
from pipelines.stages.deploy.preflight import nccl_disagreements
from pipelines.targets.dockerengines import MemberHost


def test_deploy_serves_the_model_moves_stable_and_a_second_deploy_restarts_nothing(
    world, docker_client
):
    first = deployed(world)
    assert f"the service answers at {world['url']}/v1" in first.stdout
    assert served_models(world) == [world["profile"]["model"]["served_name"]]
    container = member(docker_client, world["name"])
    digest = container.attrs["Config"]["Image"].rsplit("@", 1)[1]
    assert tag_digest(world, "stable") == digest
    mount = container.attrs["Mounts"][0]
    assert (mount["Destination"], mount["RW"]) == ("/models", False)

    second = deployed(world)
    assert "deploy: nothing restarted" in second.stdout
    again = member(docker_client, world["name"])
    assert (again.id, again.attrs["State"]["StartedAt"]) == (
        container.id,
        container.attrs["State"]["StartedAt"],
    )
    assert [r["outcome"] for r in records(world)][-2:] in (
        ["deployed", "unchanged"],
        ["unchanged", "unchanged"],
    )
    status = doit(world, "status")
    assert "doit build now: matches" in status.stdout
    assert f"member localhost: sparkforge-{world['name']}-0 running on unix://" in status.stdout

    # A profile edit that no document reads (the bench's gate, the description) restarts nothing.
    bench_only = copy.deepcopy(world["profile"])
    bench_only["description"] = "the same deployment, a stricter gate"
    bench_only["bench"]["baseline"][0]["tolerance"] = 0.04
    third = deploy_variant(world, bench_only)
    assert third.returncode == 0, third.stdout + third.stderr
    assert "deploy: nothing restarted" in third.stdout
    assert member(docker_client, world["name"]).id == container.id


def test_an_unreachable_engine_stops_the_deploy_before_anything_is_touched(world, docker_client):
    deployed(world)
    before = member(docker_client, world["name"])
    profile = {**world["profile"]}
    profile["members"] = [{**profile["members"][0], "docker": "unix:///nonexistent/docker.sock"}]
    result = deploy_variant(world, profile)

    assert result.returncode != 0
    assert (
        "member localhost: Docker engine unix:///nonexistent/docker.sock unreachable"
        " (DockerException); expected a running engine at that URL"
    ) in result.stdout + result.stderr
    assert member(docker_client, world["name"]).id == before.id
    assert records(world)[-1]["outcome"] == "refused"


def test_a_missing_image_digest_is_refused_in_preflight_naming_the_member(world, docker_client):
    deployed(world)
    before = member(docker_client, world["name"]).id
    missing = "sha256:" + "0" * 64
    # Attested as if built here (the registry takes an attestation of a missing subject): the
    # provenance check passes and the member's pull is what fails.
    stable = tag_digest(world, "stable")
    vouch_like(world, stable, missing)

    result = doit(world, "deploy", f"image_digest={missing}")

    assert result.returncode != 0
    out = result.stdout + result.stderr
    assert "preflight failed, nothing touched:" in out
    assert "member localhost: unix://" in out and f"cannot pull {world['registry']}/" in out
    assert f"@{missing}" in out and "Traceback" not in out
    assert member(docker_client, world["name"]).id == before
    assert records(world)[-1]["outcome"] == "refused"


def test_an_unknown_host_is_one_line_naming_the_member_and_its_url(world, docker_client):
    deployed(world)
    profile = {**world["profile"]}
    url = "ssh://sparkforge@no-such-host.invalid"
    profile["members"] = [{**profile["members"][0], "docker": url}]
    result = deploy_variant(world, profile)

    assert result.returncode != 0
    out = result.stdout + result.stderr
    assert f"member localhost: {url}: ssh: " in out
    assert "no-such-host.invalid" in out.split(f"{url}: ssh: ", 1)[1].splitlines()[0]
    assert records(world)[-1]["outcome"] == "refused"


def test_preflight_refuses_a_member_whose_folder_was_staged_from_another_lock(world, stack):
    deployed(world)  # a build now would stage again: the check is for members staged elsewhere
    record = records(world)[-1]
    deployment = Deployment.from_record(world["name"], record["deployment"])
    backend = DockerHosts(load_profile(world["name"], world["profiles"]), stack.docker_hosts, 10)
    source = Path(deployment.documents[0]["mounts"][0]["source"])
    marker = source.with_name(f"{source.name}.staged.json")
    good = marker.read_text()
    try:
        assert backend.preflight(deployment, False, 0, record["lock_sha256"]) == []
        marker.write_text(json.dumps({"lock_sha256": "f" * 64}))
        problems = backend.preflight(deployment, False, 0, record["lock_sha256"])
    finally:
        marker.write_text(good)
        backend.close()

    assert problems == [
        f"member localhost: model folder {source}: staged from lock sha256 {'f' * 64}, expected"
        f" {record['lock_sha256']} (stage the profile's lock on this host)"
    ]


def test_a_member_that_cannot_be_reached_does_not_stop_the_others_being_restored(
    world, stack, docker_client
):
    deployed(world)
    old = member(docker_client, world["name"])
    name, aside = old.name, f"{old.name}-prev"
    # Where an apply that failed on the next member leaves this one: old aside, new started.
    old.rename(aside)
    old.stop(timeout=10)
    new = docker_client.containers.create(old.attrs["Config"]["Image"], ["sleep", "600"], name=name)
    new.start()
    reachable = MemberHost(0, "localhost", stack.docker_hosts[0])
    dropped = MemberHost(1, "ring-b", "unix:///nonexistent/docker.sock")  # nothing listens
    backend = DockerHosts(load_profile(world["name"], world["profiles"]), stack.docker_hosts, 10)
    changes = [Change(reachable, started=name, kept=aside), Change(dropped, started=name)]
    try:
        with pytest.raises(DeployError) as refused:
            backend.restore(changes, world["name"])
    finally:
        backend.close()

    assert str(refused.value).startswith(
        "restore incomplete: member ring-b on unix:///nonexistent/docker.sock"
    )
    back = member(docker_client, world["name"])
    assert (back.id, back.status) == (old.id, "running")
    with pytest.raises(docker.errors.NotFound):
        docker_client.containers.get(new.id)


def test_a_profile_asking_for_it_gets_each_members_hygiene_applied_before_apply(world):
    deployed(world)
    profile = {**world["profile"]}
    sysctl = Path("/proc/sys/vm/min_free_kbytes")
    before = int(sysctl.read_text())
    # swap_off left false: whether this machine swaps is not the test's to decide; the floor
    # raised by 4 KiB only, and put back.
    profile["hygiene"] = {"swap_off": False, "drop_page_cache": True, "min_free_kbytes": before + 4}
    try:
        result = deploy_variant(world, profile)
        raised = int(sysctl.read_text())
    finally:
        sysctl.write_text(str(before))

    assert result.returncode == 0, result.stdout + result.stderr
    assert raised == before + 4
    lines = result.stdout.splitlines()
    done = lines.index(
        f"deploy: page cache dropped, vm.min_free_kbytes={before + 4} on member localhost"
    )
    assert done < next(i for i, line in enumerate(lines) if "smoke completion" in line)


@pytest.fixture
def ring_links():
    """Two real netdevs on this host (a veth pair): the first at MTU 9000, the other at 1500."""
    jumbo, standard = (f"sf{secrets.token_hex(3)}{end}" for end in "js")
    subprocess.run(["ip", "link", "add", jumbo, "type", "veth", "peer", "name", standard],
                   check=True)  # fmt: skip
    try:
        subprocess.run(["ip", "link", "set", jumbo, "mtu", "9000"], check=True)
        yield jumbo, standard
    finally:
        subprocess.run(["ip", "link", "del", jumbo], check=False)


def rdma_device(root: Path, name: str, ndev: str, state="4: ACTIVE", kind="RoCE v2", gid=3):
    """An RDMA device as the kernel's sysfs shows it (drivers/infiniband/core/sysfs.c): port 1's
    state, and the type and netdev of the GID at index gid."""
    port = root / name / "ports" / "1"
    for attribute, value in (("types", kind), ("ndevs", ndev)):
        (port / "gid_attrs" / attribute).mkdir(parents=True, exist_ok=True)
        (port / "gid_attrs" / attribute / str(gid)).write_text(value + "\n")
    (port / "state").write_text(state + "\n")


def test_preflight_checks_each_fabric_device_port_gid_and_mtu(world, stack, tmp_path, ring_links):
    deployed(world)
    deployment = Deployment.from_record(world["name"], records(world)[-1]["deployment"])
    jumbo, standard = ring_links
    rdma = tmp_path / "infiniband"
    rdma_device(rdma, "rocep1s0f0", jumbo)
    rdma_device(rdma, "rocep1s0f1", standard)
    rdma_device(rdma, "roceP2p1s0f0", jumbo, state="1: DOWN")
    rdma_device(rdma, "roceP2p1s0f1", jumbo, kind="IB/RoCE v1")
    ring = load_profile("tp4-ring")
    typo = msgspec.structs.replace(
        ring, fabric=msgspec.structs.replace(ring.fabric, ib_hca=["rocep1s0f0:1", "rocep1s0f2"])
    )
    found = {}
    for case, profile, sysfs in [
        ("ring", ring, str(rdma)),
        ("typo", typo, str(rdma)),
        ("this host", ring, None),  # its own /sys: no RDMA device at all
    ]:
        backend = DockerHosts(profile, stack.docker_hosts, 10, rdma_sysfs=sysfs)
        try:
            found[case] = backend.preflight(deployment, False, 0)
        finally:
            backend.close()

    assert found["ring"] == [
        f"member localhost: fabric device rocep1s0f1 port 1 (netdev {standard}): MTU 1500,"
        " expected 9000 (fabric.mtu)",
        "member localhost: fabric device roceP2p1s0f0 port 1: state '1: DOWN', expected ACTIVE"
        " (its link or neighbour down?)",
        "member localhost: fabric device roceP2p1s0f1 port 1: GID index 3 is IB/RoCE v1, expected"
        " RoCE v2 (fabric.ib_gid_index)",
    ]
    assert found["typo"] == [
        "member localhost: fabric device rocep1s0f2: not on this host (it has: roceP2p1s0f0,"
        " roceP2p1s0f1, rocep1s0f0, rocep1s0f1), expected every device of fabric.ib_hca"
    ]
    assert found["this host"] == [
        f"member localhost: fabric device {hca}: not on this host (it has: none), expected every"
        " device of fabric.ib_hca"
        for hca in ring.fabric.ib_hca
    ]


def test_preflight_checks_that_every_member_mounts_the_same_patched_nccl(
    world, stack, tmp_path, ring_links
):
    deployed(world)
    base = records(world)[-1]["deployment"]["documents"][0]
    libraries = {}
    for name, content in {
        "patched": b"\x7fELF... NCCL 2.30 SWITCHLESS_RING_ONLY ...",
        "rebuilt": b"\x7fELF... NCCL 2.30 SWITCHLESS_RING_ONLY (rebuilt) ...",
        "stock": b"\x7fELF... NCCL 2.30 ...",
    }.items():
        libraries[name] = tmp_path / name / "libnccl.so.2"
        libraries[name].parent.mkdir()
        libraries[name].write_bytes(content)
    overlay = "/usr/local/lib/python3.12/dist-packages/nvidia/nccl/lib/libnccl.so.2"

    def ring(*names: str) -> Deployment:
        plans = tuple(
            {
                **base,
                "rank": rank,
                "node": f"spark-{rank + 1}",
                "mounts": [*base["mounts"], {"source": str(libraries[name]), "target": overlay}],
            }
            for rank, name in enumerate(names)
        )
        engines = (stack.docker_hosts[0],) * len(names)
        return Deployment("tp4-ring", "k", plans, base["image"], engines)

    # Its fabric asks for sparkring; its devices are all up, RoCE v2 at MTU 9000.
    rdma = tmp_path / "infiniband"
    profile = load_profile("tp4-ring")
    for hca in profile.fabric.ib_hca:
        rdma_device(rdma, hca, ring_links[0])
    backend = DockerHosts(profile, (), 10, rdma_sysfs=str(rdma))
    try:
        same = backend.preflight(ring("patched", "patched"), False, 0)
        mixed = backend.preflight(ring("patched", "rebuilt", "stock"), False, 0)
    finally:
        backend.close()

    digest = {n: hashlib.sha256(p.read_bytes()).hexdigest() for n, p in libraries.items()}
    assert same == []
    assert mixed == [
        f"member spark-3: NCCL library {libraries['stock']}: no SWITCHLESS_RING_ONLY in it,"
        " expected the patched (sparkring) build",
        f"member spark-2: NCCL library sha256 {digest['rebuilt']}, expected"
        f" {digest['patched']} (as on spark-1)",
        f"member spark-3: NCCL library sha256 {digest['stock']}, expected"
        f" {digest['patched']} (as on spark-1)",
    ]


def test_a_pinned_nccl_hash_is_required_of_every_member_not_only_agreement():
    same, pin = "1" * 64, "2" * 64
    assert nccl_disagreements({"spark-1": same, "spark-2": same}) == []
    assert nccl_disagreements({"spark-1": same, "spark-2": pin}, pin) == [
        f"member spark-1: NCCL library sha256 {same}, expected {pin} (sglang.nccl_overlay.sha256)"
    ]
