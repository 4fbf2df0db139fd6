"""`doit deploy` on the local stack, as a user runs it: the simulated runtime in containers of
the stack's engine, `:stable` in the stack's registry (under a namespace of the tests' own)."""

from __future__ import annotations

import copy
import hashlib
import io
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import docker
import msgspec
import pytest
import requests
import yaml
from conftest import delete_repository

from pipelines.deploy.dockerhosts import Change, DockerHosts
from pipelines.deploy.plan import Deployment
from pipelines.deploy.preflight import nccl_disagreements
from pipelines.errors import DeployError
from pipelines.images.registry import ACCEPT
from pipelines.paths import PROFILES_DIR
from pipelines.profiles import load_profile
from pipelines.targets.dockerengines import MemberHost

REPO = Path(__file__).resolve().parent.parent
NAME = f"deploytest{uuid.uuid4().hex[:6]}"


def free_port() -> int:
    """A port nothing listens on now (the simulator binds it a few seconds later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(count: int) -> int:
    """The first of `count` consecutive ports nothing listens on now."""
    while True:
        first = free_port()
        if all(port_is_free(first + i) for i in range(1, count)):
            return first


def port_is_free(port: int) -> bool:
    """Whether nothing holds port on 127.0.0.1."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.fixture(scope="module")
def space(stack, tmp_path_factory, docker_client):
    """A store, a profiles folder and a registry namespace of the module's own (the image is
    built once for all its tests); its containers and tags are removed at the end."""
    root = tmp_path_factory.mktemp("deploy")
    profiles = root / "profiles"
    profiles.mkdir()
    namespace = f"sparkforge-test-{uuid.uuid4().hex[:8]}"
    env = {
        **os.environ,
        "SPARKFORGE_STORE": str(root / "store"),
        "SPARKFORGE_PROFILES": str(profiles),
        "SPARKFORGE_REGISTRY_NAMESPACE": namespace,
        "SPARKFORGE_DEPLOY_TIMEOUT": "15",
    }
    repository = f"{namespace}/sparkforge/local-sim"
    yield {"env": env, "profiles": profiles, "store": root / "store", "repository": repository}
    engines = [docker_client]
    if len(stack.docker_hosts) > 1:
        engines.append(docker.DockerClient(base_url=second_engine(stack)))
    for client in engines:
        for container in client.containers.list(all=True, filters={"name": NAME}):
            container.remove(force=True)
    delete_repository(stack.registry, repository)


def second_engine(stack) -> str:
    """The stack's second engine, straight on its socket (the tests' own view of it)."""
    return f"unix://{stack.docker_hosts[1].split('127.0.0.1:', 1)[1].split('/', 1)[1]}"


def make_world(space, stack, base: str, name: str) -> dict:
    """A profile called name made from profiles/<base>.yaml on free ports, in the space."""
    profile = yaml.safe_load((PROFILES_DIR / f"{base}.yaml").read_text())
    profile["name"] = name
    profile["simulator"]["port"] = free_ports(len(profile["members"]))
    (space["profiles"] / f"{name}.yaml").write_text(yaml.safe_dump(profile))
    return {
        **space,
        "name": name,
        "profile": profile,
        "url": f"http://127.0.0.1:{profile['simulator']['port']}",
        "registry": stack.registry,
    }


@pytest.fixture(scope="module")
def world(space, stack):
    """One member on the stack's engine (the local profile, renamed, on a free port)."""
    return make_world(space, stack, "local", NAME)


@pytest.fixture(scope="module")
def ring(space, stack):
    """Two members: one on the stack's engine, one on its second engine over ssh://."""
    return make_world(space, stack, "local-ring", f"{NAME}ring")


def doit(world, *args: str, **env: str) -> subprocess.CompletedProcess:
    """Run doit in the checkout on the test's profile, store and namespace."""
    return subprocess.run(
        [sys.executable, "-m", "doit", *args, f"profile={world['name']}"],
        cwd=REPO,
        env={**world["env"], **env},
        capture_output=True,
        text=True,
        timeout=600,
    )


def tag_digest(world, tag: str) -> str | None:
    """The digest a tag of the test's repository points to, if any."""
    r = requests.head(
        f"http://{world['registry']}/v2/{world['repository']}/manifests/{tag}",
        headers={"Accept": ACCEPT},
        timeout=10,
    )
    return r.headers["Docker-Content-Digest"] if r.status_code == 200 else None


def served_models(world) -> list[str]:
    """The model names the deployed service lists."""
    answer = requests.get(f"{world['url']}/v1/models", timeout=5).json()
    return [card["id"] for card in answer["data"]]


def member(docker_client, name: str = NAME, rank: int = 0):
    """A member's container."""
    return docker_client.containers.get(f"sparkforge-{name}-{rank}")


def records(world) -> list[dict]:
    """The deployment records, oldest first."""
    folder = world["store"] / "deployments" / world["name"]
    return [
        json.loads(p.read_text()) for p in sorted(folder.glob("*.json"), key=lambda p: int(p.stem))
    ]


def derived_image(world, docker_client, tag: str, cmd: list[str] | None = None) -> str:
    """An image made from the deployed one (another CMD, a label), pushed; returns its digest."""
    base = member(docker_client).attrs["Config"]["Image"]
    lines = [f"FROM {base}", f"LABEL dev.sparkforge.test={tag}"]
    if cmd:
        lines.append(f"CMD {json.dumps(cmd)}")
    ref = f"{world['registry']}/{world['repository']}"
    docker_client.images.build(fileobj=io.BytesIO("\n".join(lines).encode()), tag=f"{ref}:{tag}")
    docker_client.images.push(ref, tag=tag)
    return tag_digest(world, tag)


def deploy_variant(world, profile: dict, *args: str, **env: str) -> subprocess.CompletedProcess:
    """`doit deploy` with the test's profile replaced by profile for this one run."""
    path = world["profiles"] / f"{world['name']}.yaml"
    path.write_text(yaml.safe_dump(profile))
    try:
        return doit(world, "deploy", *args, **env)
    finally:
        path.write_text(yaml.safe_dump(world["profile"]))


def deployed(world):
    """The latest deploy, made sure to have served."""
    result = doit(world, "deploy")
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def test_deploy_serves_the_model_moves_stable_and_a_second_deploy_restarts_nothing(
    world, docker_client
):
    first = deployed(world)
    assert f"the service answers at {world['url']}/v1" in first.stdout
    assert served_models(world) == [world["profile"]["model"]["served_name"]]
    container = member(docker_client)
    digest = container.attrs["Config"]["Image"].rsplit("@", 1)[1]
    assert tag_digest(world, "stable") == digest
    mount = container.attrs["Mounts"][0]
    assert (mount["Destination"], mount["RW"]) == ("/models", False)

    second = deployed(world)
    assert "deploy: nothing restarted" in second.stdout
    again = member(docker_client)
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
    assert f"member localhost: sparkforge-{NAME}-0 running on unix://" in status.stdout

    # A profile edit that no document reads (the bench's gate, the description) restarts nothing.
    bench_only = copy.deepcopy(world["profile"])
    bench_only["description"] = "the same deployment, a stricter gate"
    bench_only["bench"]["baseline"][0]["tolerance"] = 0.04
    third = deploy_variant(world, bench_only)
    assert third.returncode == 0, third.stdout + third.stderr
    assert "deploy: nothing restarted" in third.stdout
    assert member(docker_client).id == container.id


def test_a_broken_image_is_rolled_back_and_stable_does_not_move(world, docker_client):
    deployed(world)
    good = member(docker_client)
    stable = tag_digest(world, "stable")
    broken = derived_image(
        world, docker_client, "broken", ["python3", "-c", "import time; time.sleep(3600)"]
    )

    result = doit(world, "deploy", f"image_digest={broken}")

    assert result.returncode != 0
    out = result.stdout + result.stderr
    assert "member localhost on unix://" in out
    assert f"{world['url']}: not serving after 15 s" in out
    assert "the previous deployment was restored" in out
    assert "Traceback" not in out
    back = member(docker_client)
    assert back.id == good.id and back.status == "running"
    assert served_models(world) == [world["profile"]["model"]["served_name"]]
    assert tag_digest(world, "stable") == stable
    assert records(world)[-1]["outcome"] == "rolled back"
    assert broken in records(world)[-1]["image"]


def test_rollback_restores_the_previous_deployment_and_stable_prev(world, docker_client):
    deployed(world)
    first = tag_digest(world, "stable")
    variant = derived_image(world, docker_client, "variant")
    moved = doit(world, "deploy", f"image_digest={variant}")
    assert moved.returncode == 0, moved.stdout + moved.stderr
    assert (tag_digest(world, "stable"), tag_digest(world, "stable-prev")) == (variant, first)

    result = doit(world, "rollback")

    assert result.returncode == 0, result.stdout + result.stderr
    assert tag_digest(world, "stable") == first
    assert member(docker_client).attrs["Config"]["Image"].endswith(first)
    assert served_models(world) == [world["profile"]["model"]["served_name"]]
    assert records(world)[-1]["outcome"] == "restored"


def test_an_unreachable_engine_stops_the_deploy_before_anything_is_touched(world, docker_client):
    deployed(world)
    before = member(docker_client)
    profile = {**world["profile"]}
    profile["members"] = [{**profile["members"][0], "docker": "unix:///nonexistent/docker.sock"}]
    result = deploy_variant(world, profile)

    assert result.returncode != 0
    assert (
        "member localhost: Docker engine unix:///nonexistent/docker.sock unreachable"
        " (DockerException); expected a running engine at that URL"
    ) in result.stdout + result.stderr
    assert member(docker_client).id == before.id
    assert records(world)[-1]["outcome"] == "refused"


def serves_on(port: int) -> list[str]:
    """The model names a member on this machine's port lists."""
    answer = requests.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).json()
    return [card["id"] for card in answer["data"]]


def ring_containers(ring, stack, docker_client) -> list:
    """The ring's two containers: rank 0 on the first engine, rank 1 on the second."""
    second = docker.DockerClient(base_url=second_engine(stack))
    return [member(docker_client, ring["name"], 0), member(second, ring["name"], 1)]


def test_a_ring_deploys_one_member_per_engine_one_over_ssh_and_redeploys_nothing(
    ring, stack, docker_client
):
    result = deployed(ring)
    assert stack.docker_hosts[1].startswith("ssh://")
    port = ring["profile"]["simulator"]["port"]
    served = ring["profile"]["model"]["served_name"]
    assert serves_on(port) == [served] and serves_on(port + 1) == [served]
    containers = ring_containers(ring, stack, docker_client)
    with pytest.raises(docker.errors.NotFound):
        member(docker_client, ring["name"], 1)  # rank 1 lives on the second engine only
    assert "member ring-b" not in result.stdout

    again = deployed(ring)
    assert "deploy: nothing restarted" in again.stdout
    assert [c.id for c in ring_containers(ring, stack, docker_client)] == [c.id for c in containers]


def test_a_member_failing_on_one_host_rolls_back_every_member(ring, stack, docker_client):
    deployed(ring)
    before = ring_containers(ring, stack, docker_client)
    old_port = ring["profile"]["simulator"]["port"]
    changed = {**ring["profile"], "simulator": {**ring["profile"]["simulator"]}}
    new_port = free_ports(2)
    changed["simulator"]["port"] = new_port
    # Member 1's host has its new port taken: its server cannot start there.
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", new_port + 1))
        taken.listen()
        result = deploy_variant(ring, changed)

    assert result.returncode != 0
    out = result.stdout + result.stderr
    assert "member ring-b on ssh://" in out and "exited (1)" in out
    assert "the previous deployment was restored" in out
    after = ring_containers(ring, stack, docker_client)
    assert [c.id for c in after] == [c.id for c in before]
    assert [c.status for c in after] == ["running", "running"]
    served = ring["profile"]["model"]["served_name"]
    assert serves_on(old_port) == [served] and serves_on(old_port + 1) == [served]
    assert records(ring)[-1]["outcome"] == "rolled back"


def test_a_refused_ssh_key_stops_the_ring_deploy_before_anything_is_touched(
    ring, stack, docker_client, tmp_path
):
    deployed(ring)
    before = [c.id for c in ring_containers(ring, stack, docker_client)]
    stranger = tmp_path / "stranger"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", stranger], check=True)

    result = doit(ring, "deploy", SPARKFORGE_SSH_IDENTITY=str(stranger))

    assert result.returncode != 0
    out = result.stdout + result.stderr
    assert f"member ring-b: {stack.docker_hosts[1]}: ssh: " in out
    assert "Permission denied (publickey)" in out
    assert "Traceback" not in out
    assert [c.id for c in ring_containers(ring, stack, docker_client)] == before
    assert records(ring)[-1]["outcome"] == "refused"


@pytest.mark.parametrize(
    ("sent", "reason"),
    [
        (signal.SIGINT, "KeyboardInterrupt"),
        (signal.SIGTERM, "Terminated"),
        (signal.SIGHUP, "Terminated"),
    ],
    ids=["ctrl-c", "sigterm", "sighup"],
)
def test_ctrl_c_or_a_stop_signal_during_a_deploy_restores_the_previous_one(
    world, docker_client, sent, reason
):
    """Ctrl-C at a terminal; SIGTERM or SIGHUP as a cancelled CI job or a timeout sends."""
    deployed(world)
    good = member(docker_client)
    broken = derived_image(
        world, docker_client, "stuck", ["python3", "-c", "import time; time.sleep(3600)"]
    )
    deploy = subprocess.Popen(
        [sys.executable, "-m", "doit", "deploy", f"profile={NAME}", f"image_digest={broken}"],
        cwd=REPO,
        env={**world["env"], "SPARKFORGE_DEPLOY_TIMEOUT": "300", "PYTHONFAULTHANDLER": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        # As at a terminal: a suite started in the background (`cmd &`, nohup) has SIGINT (and
        # SIGHUP) ignored, which its children inherit, and then no signal reaches the deploy.
        preexec_fn=lambda: [signal.signal(s, signal.SIG_DFL) for s in (sent, signal.SIGINT)],
    )
    # Interrupt once the new container runs: the deploy is then waiting for it to serve.
    deadline = time.monotonic() + 300
    while deploy.poll() is None and time.monotonic() < deadline:
        containers = docker_client.containers.list(filters={"name": f"sparkforge-{NAME}-0$"})
        if containers and containers[0].attrs["Config"]["Image"].endswith(broken):
            break
        time.sleep(0.2)
    deploy.send_signal(sent)
    try:
        out, _ = deploy.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        # Where it hangs (faulthandler prints every thread on SIGABRT), and no deploy left
        # running to race the next test.
        deploy.send_signal(signal.SIGABRT)
        out, _ = deploy.communicate(timeout=60)
        pytest.fail(f"deploy still running 120 s after {sent.name}:\n{out}")

    assert deploy.returncode != 0, out
    back = member(docker_client)
    assert back.id == good.id and back.status == "running"
    assert served_models(world) == [world["profile"]["model"]["served_name"]]
    last = records(world)[-1]
    assert (last["outcome"], last["reason"]) == ("rolled back", reason)


def test_a_missing_image_digest_is_refused_in_preflight_naming_the_member(world, docker_client):
    deployed(world)
    before = member(docker_client).id
    missing = "sha256:" + "0" * 64

    result = doit(world, "deploy", f"image_digest={missing}")

    assert result.returncode != 0
    out = result.stdout + result.stderr
    assert "preflight failed, nothing touched:" in out
    assert "member localhost: unix://" in out and f"cannot pull {world['registry']}/" in out
    assert f"@{missing}" in out and "Traceback" not in out
    assert member(docker_client).id == before
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
    deployment = Deployment.from_record(NAME, record["deployment"])
    backend = DockerHosts(load_profile(NAME, world["profiles"]), stack.docker_hosts, 10)
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
    old = member(docker_client)
    name, aside = old.name, f"{old.name}-prev"
    # Where an apply that failed on the next member leaves this one: old aside, new started.
    old.rename(aside)
    old.stop(timeout=10)
    new = docker_client.containers.create(old.attrs["Config"]["Image"], ["sleep", "600"], name=name)
    new.start()
    reachable = MemberHost(0, "localhost", stack.docker_hosts[0])
    dropped = MemberHost(1, "ring-b", "tcp://127.0.0.1:9")  # the discard port: nothing listens
    backend = DockerHosts(load_profile(NAME, world["profiles"]), stack.docker_hosts, 10)
    changes = [Change(reachable, started=name, kept=aside), Change(dropped, started=name)]
    try:
        with pytest.raises(DeployError) as refused:
            backend.restore(changes, NAME)
    finally:
        backend.close()

    assert str(refused.value).startswith("restore incomplete: member ring-b on tcp://127.0.0.1:9")
    back = member(docker_client)
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
    deployment = Deployment.from_record(NAME, records(world)[-1]["deployment"])
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


def bench_results(world) -> list[Path]:
    """The bench's result folders of the test's profile, oldest first."""
    return sorted((world["store"] / "bench" / world["name"]).glob("*"))


def test_a_pinned_nccl_hash_is_required_of_every_member_not_only_agreement():
    same, pin = "1" * 64, "2" * 64
    assert nccl_disagreements({"spark-1": same, "spark-2": same}) == []
    assert nccl_disagreements({"spark-1": same, "spark-2": pin}, pin) == [
        f"member spark-1: NCCL library sha256 {same}, expected {pin} (sglang.nccl_overlay.sha256)"
    ]


def test_bench_after_deploy_writes_results_report_and_plots_and_passes_the_gate(world):
    deployed(world)
    result = doit(world, "bench")
    assert result.returncode == 0, result.stdout + result.stderr
    folder = bench_results(world)[-1]
    assert result.stdout.rstrip().endswith(f"bench: report {folder / 'report.md'}")
    results = json.loads((folder / "results.json").read_text())
    assert results["verdict"] == "passed" and results["failures"] == []
    assert [c["concurrency"] for c in results["decode"]] == [1, 2, 4, 8]
    last = records(world)[-1]
    assert results["provenance"]["image"] == last["image"]
    assert results["provenance"]["manifests_key"] == last["deployment"]["key"]
    assert results["provenance"]["endpoint"] == world["url"]
    assert len(results["decode"][3]["requests"]) == 8  # raw timings kept
    assert (folder / "decode.png").stat().st_size > 0 and (folder / "needles.png").is_file()
    assert "## Gate" in (folder / "report.md").read_text()


def test_a_simulator_set_20_percent_slower_fails_the_bench_naming_the_metric(world):
    slower = json.loads(json.dumps(world["profile"]))
    slower["simulator"]["decode_tok_s"] *= 0.8
    path = world["profiles"] / f"{world['name']}.yaml"
    try:
        assert deploy_variant(world, slower).returncode == 0
        path.write_text(yaml.safe_dump(slower))
        result = doit(world, "bench")
    finally:
        path.write_text(yaml.safe_dump(world["profile"]))
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "decode.c1.median_window_tok_s: 3" in output and "(-20.0%" in output
    folder = bench_results(world)[-1]
    assert json.loads((folder / "results.json").read_text())["verdict"] == "failed"
    deployed(world)  # the test's own profile again, for the tests after this one


# --- ring staging (last: its ring stays deployed, beside the others) ---------------------


@pytest.fixture(scope="module")
def staging_ring(space, stack, tmp_path_factory):
    """The ring with a weights folder per member and its own link address on loopback
    (127.0.0.2 and 127.0.0.3), as two hosts would have: each member's blob server and folder
    are its own although both engines run on this machine."""
    world = make_world(space, stack, "local-ring", f"{NAME}stage")
    roots = [tmp_path_factory.mktemp(f"member{rank}") for rank in range(2)]
    profile = world["profile"]
    profile["members"][0].update(weights_root=str(roots[0]), links={"ring-b": "127.0.0.2"})
    profile["members"][1].update(weights_root=str(roots[1]), links={"ring-a": "127.0.0.3"})
    profile["staging"] = {"port": free_port(), "peer_wait_s": 120}
    (space["profiles"] / f"{world['name']}.yaml").write_text(yaml.safe_dump(profile))
    lock = yaml.safe_load((REPO / "weights" / f"{profile['model']['lock']}.lock.yaml").read_text())
    return {**world, "roots": roots, "lock": lock}


DONE = re.compile(
    r"stage_ring (ring-[ab]): done: (\d+) files verified, ([\d.]+) MiB from S3, ([\d.]+) MiB from"
    r" peers"
)


def done_members(out: str) -> dict[str, tuple[int, float, float]]:
    """Per member of stage_ring's output: files verified, MiB from S3, MiB from peers."""
    return {m[0]: (int(m[1]), float(m[2]), float(m[3])) for m in DONE.findall(out)}


def stage_with_second_root(staging_ring, root: Path) -> subprocess.CompletedProcess:
    """stage_ring with ring-b's weights at root for this run only."""
    profile = yaml.safe_load(yaml.safe_dump(staging_ring["profile"]))
    profile["members"][1]["weights_root"] = str(root)
    path = staging_ring["profiles"] / f"{staging_ring['name']}.yaml"
    path.write_text(yaml.safe_dump(profile))
    try:
        return doit(staging_ring, "stage_ring")
    finally:
        path.write_text(yaml.safe_dump(staging_ring["profile"]))


def stager_containers(stack, docker_client) -> list:
    """Staging containers left on either engine."""
    second = docker.DockerClient(base_url=second_engine(stack))
    return [
        c
        for client in (docker_client, second)
        for c in client.containers.list(all=True, filters={"name": "-stage-"})
        if NAME in c.name
    ]


def test_stage_ring_takes_each_file_from_s3_once_and_the_rest_from_the_peer_then_deploys(
    staging_ring, stack, docker_client
):
    result = doit(staging_ring, "stage_ring")
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    done = done_members(out)
    files = staging_ring["lock"]["files"]
    total_mib = sum(f["size"] for f in files) / (1 << 20)
    assert set(done) == {"ring-a", "ring-b"}
    assert all(n == len(files) for n, _, _ in done.values())
    # One model from S3 between the two (each prints to 0.1 MiB), the rest over the link.
    assert abs(sum(s3 for _, s3, _ in done.values()) - total_mib) < 0.2
    assert all(peers > 0.2 * total_mib for _, _, peers in done.values())
    assert "stage_ring ring-b: serving on 127.0.0.3:" in out  # on its own link address
    assert stager_containers(stack, docker_client) == []

    lock_sha = hashlib.sha256(
        (REPO / "weights" / f"{staging_ring['profile']['model']['lock']}.lock.yaml").read_bytes()
    ).hexdigest()
    key = hashlib.sha256(staging_ring["profile"]["model"]["source"].encode()).hexdigest()[:16]
    for root in staging_ring["roots"]:
        folder = root / "models" / key
        for f in files:
            data = (folder / f["name"]).read_bytes()
            assert hashlib.sha256(data).hexdigest() == f["sha256"], (root, f["name"])
            blob = root / "blobs" / "sha256" / f["sha256"]
            assert (folder / f["name"]).stat().st_ino == blob.stat().st_ino  # a hard link
        staged = json.loads((folder.parent / f"{key}.staged.json").read_text())
        assert staged == {"lock_sha256": lock_sha}

    # Deploy finds each member's own folder staged (preflight) and mounts it.
    deployed(staging_ring)
    second = docker.DockerClient(base_url=second_engine(stack))
    for rank, client in enumerate((docker_client, second)):
        mounts = member(client, staging_ring["name"], rank).attrs["Mounts"]
        assert [m["Source"] for m in mounts] == [str(staging_ring["roots"][rank] / "models" / key)]


def test_stage_ring_again_fetches_nothing(staging_ring):
    result = doit(staging_ring, "stage_ring")
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    done = done_members(out)
    assert set(done) == {"ring-a", "ring-b"}
    assert all(s3 == 0 and peers == 0 for _, s3, peers in done.values()), done


def test_a_member_that_cannot_stage_is_named_with_its_log_and_no_container_is_left(
    staging_ring, stack, stack_env, docker_client, tmp_path
):
    not_a_folder = tmp_path / "not-a-folder"
    not_a_folder.write_text("a file where ring-b's weights folder should be\n")
    result = stage_with_second_root(staging_ring, not_a_folder)
    out = result.stdout + result.stderr
    assert result.returncode != 0
    failed = [line for line in out.splitlines() if "member ring-b: staging exited" in line]
    assert len(failed) == 1 and "not-a-folder" in failed[0], out
    assert "member ring-a: staging exited" not in out  # ring-a is stopped, not failed
    assert stack_env["AWS_SECRET_ACCESS_KEY"] not in out
    assert stager_containers(stack, docker_client) == []


def test_a_fresh_nodes_missing_weights_folder_is_made(staging_ring, tmp_path):
    fresh = tmp_path / "fresh" / "weights"
    result = stage_with_second_root(staging_ring, fresh)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    done = done_members(out)
    files = staging_ring["lock"]["files"]
    total_mib = sum(f["size"] for f in files) / (1 << 20)
    # ring-a has everything already; the fresh ring-b takes its own share from S3, as planned,
    # and the rest from ring-a.
    assert done["ring-a"][1:] == (0.0, 0.0), done
    assert abs(done["ring-b"][1] + done["ring-b"][2] - total_mib) < 0.2 and done["ring-b"][2] > 0
    assert len(list((fresh / "blobs" / "sha256").iterdir())) == len(files)
