"""Fabric check: NCCL logs from two real H200s, hand-cut ring variants, expectations, rendering."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import docker.errors
import msgspec
import pytest
import yaml
from kube_api import KubeDouble, KubeServer, job_status
from support import stages

import devstack as local_stack
from pipelines.core.modellock import load_lock, lock_path
from pipelines.core.paths import FABRIC_PROBE, PATCH_SOURCE, PROFILES_DIR
from pipelines.core.profiles import ProfileError, load_profile
from pipelines.core.site import Site
from pipelines.engine.steps import Engine
from pipelines.engine.store import Store
from pipelines.stages.deploy.docker import DockerHosts
from pipelines.stages.deploy.plan import Deployment
from pipelines.stages.fabric import Fabric, fabric_refusal, fabric_verdict
from pipelines.stages.fabric.expect import (
    TOLERANCE,
    TP3_MEASURED_BUSBW,
    Expectations,
    FabricError,
    expectations_for,
    failures,
    parse_expectation,
)
from pipelines.stages.fabric.launch import DockerLauncher, KubernetesLauncher, MemberRun
from pipelines.stages.fabric.nccllog import bus_bandwidth, parse_log
from pipelines.stages.render import fabric as render_fabric
from pipelines.stages.render.documents import Document, RenderInputs
from pipelines.stages.render.validate import validate_documents
from pipelines.targets.dockerengines import DockerEngines, MemberHost
from pipelines.targets.kubeapi import KubeAccess

REPO = Path(__file__).resolve().parent.parent
NCCL = REPO / "tests" / "data" / "nccl"
GIB = 1 << 30
RING_HCAS = ("rocep1s0f0", "rocep1s0f1", "roceP2p1s0f0", "roceP2p1s0f1")
# The launcher is the test's own: no engines to reach.
NO_ENGINES = Site(lambda: ("", ()))
# What NCCL 2.28's net_ib prints for a Spark's four RoCE devices (format of `NET/IB : Using`).
IB_USING = (
    "spark-1:2201:2240 [0] NCCL INFO NET/IB : Using [0]rocep1s0f0:1/RoCE [1]rocep1s0f1:1/RoCE"
    " [2]roceP2p1s0f0:1/RoCE [3]roceP2p1s0f1:1/RoCE [RO]; OOB enP7s7:192.168.100.11<0>"
)


def fixture(name: str) -> str:
    """A raw log taken on the H200 pair (tests/data/nccl/README.md says how)."""
    return (NCCL / name).read_text()


def ib_ring_log(channels_on_socket: int = 0, using: str = IB_USING) -> str:
    """The real NET/Socket log made to look like a RoCE ring: device list and channels on IB."""
    lines, socket_left = [], channels_on_socket
    for line in fixture("nccltests-socket.log").replace("\nvm:", "\nspark-1:").splitlines():
        if "NET/IB : Using" in line:
            line = using
        elif "via NET/Socket/0" in line:
            if socket_left:
                socket_left -= 1
            else:
                line = line.replace("via NET/Socket/0", "via NET/IB/1/GDRDMA")
        lines.append(line)
    return "\n".join(lines)


def test_the_p2p_log_gives_every_channel_on_p2p_and_the_result_table():
    log = parse_log(fixture("nccltests-p2p.log"))
    assert len(log.channels) == 48  # 24 channels, both directions
    assert log.transports == {"P2P"}
    assert log.channels[0].via == "P2P/direct pointer"
    assert [r.size for r in log.results] == [8 * (1 << 20) << i for i in range(8)]
    assert log.largest.size == GIB
    assert log.largest.busbw == 328.17  # the slower of out-of-place 328.17 and in-place 328.82
    assert log.largest.wrong == 0
    assert log.avg_busbw == 264.732
    assert log.versions == {"2.28.3+cuda13.0"}
    assert log.errors == []


def test_the_socket_log_gives_every_channel_on_net_socket_device_0():
    log = parse_log(fixture("nccltests-socket.log"))
    assert log.transports == {"NET/Socket"}
    assert {(c.direction, c.net_device) for c in log.channels} == {("send", 0), ("receive", 0)}
    assert log.largest.busbw == 2.93
    assert log.networks == {"Socket"}
    assert log.ib_devices == {"vm": {}}  # `NET/IB : No device found.`, then an empty list


def test_the_probe_log_gets_busbw_by_the_nccl_tests_formula():
    log = parse_log(fixture("torch-p2p.log"))
    assert log.transports == {"P2P"}
    assert log.largest.size == GIB
    assert log.largest.busbw == pytest.approx(326.719)  # two ranks: 2(n-1)/n = 1
    assert log.versions == {"2.28.9+cuda13.0"}  # torch's own NCCL, not the system's
    three = parse_log(
        "allreduce bytes=1073741824 count=268435456 type=float32 ranks=3 time_us=75000.0"
        " algbw_gbs=14.316 wrong=0"
    )
    assert three.largest.busbw == pytest.approx(14.316 * 4 / 3)
    assert bus_bandwidth(30.0, 4) == pytest.approx(45.0)


def test_a_ring_expectation_fails_the_socket_run_naming_net_socket_and_the_busbw():
    ring = expectations_for(load_profile("tp3-ring"))
    assert ring == Expectations("NET/IB", 20.88, RING_HCAS)
    assert ring.min_busbw_gbs == round(TP3_MEASURED_BUSBW * TOLERANCE, 2)
    for name, busbw in (("nccltests-socket.log", "2.93"), ("torch-socket.log", "2.85")):
        lines = failures(parse_log(fixture(name)), ring)
        [transport] = [line for line in lines if line.startswith("transport:")]
        assert "8 of 8 channel connections via NET/Socket" in transport
        assert f"({busbw} GB/s busbw at 1073741824 bytes)" in transport
        assert "expected every channel via NET/IB" in transport
        assert (
            f"busbw: {busbw} GB/s busbw at 1073741824 bytes, expected at least 20.88 GB/s" in lines
        )
        assert any(line.startswith("HCA: no NET/IB device list") for line in lines)


def test_p2p_at_200_gbs_passes_the_nvlink_runs_and_fails_the_socket_runs():
    nvlink = parse_expectation("P2P>=200")
    assert nvlink == Expectations("P2P", 200.0)
    assert failures(parse_log(fixture("nccltests-p2p.log")), nvlink) == []
    assert failures(parse_log(fixture("torch-p2p.log")), nvlink) == []
    lines = failures(parse_log(fixture("nccltests-socket.log")), nvlink)
    assert lines[-1] == "busbw: 2.93 GB/s busbw at 1073741824 bytes, expected at least 200 GB/s"
    slower = failures(parse_log(fixture("nccltests-p2p.log")), parse_expectation("P2P>=400"))
    assert slower == ["busbw: 328.17 GB/s busbw at 1073741824 bytes, expected at least 400 GB/s"]


def test_one_channel_on_socket_among_ib_ones_is_named():
    ring = Expectations("NET/IB", None, RING_HCAS)
    assert failures(parse_log(ib_ring_log()), ring) == []
    log = parse_log(ib_ring_log(channels_on_socket=1))
    assert log.transports == {"NET/IB", "NET/Socket"}
    assert log.hcas_used() == {"rocep1s0f1"}  # `NET/IB/1` is device [1] of the list
    [line] = failures(log, ring)
    assert line.startswith("transport: 1 of 8 channel connections via NET/Socket (2.93 GB/s")
    assert "via NET/Socket/0; expected every channel via NET/IB" in line


def test_an_ncclsystemerror_at_channel_setup_fails_with_its_lines():
    # A three-rank ring without subnet-aware routing, cut where NCCL connects the first
    # channel: NCCL's WARN, the error code climbing the stack, torch's exception.
    text = fixture("nccltests-socket.log").split("Channel 00/0 :")[0].rsplit("\n", 1)[0]
    text += (
        "\n[2026-11-30 21:02:11] spark-1:2201:2250 [0] transport/net_ib/connect.cc:512 NCCL WARN"
        " NET/IB : ibv_modify_qp failed with 110 Connection timed out, on dev rocep1s0f0:1,"
        " curr state INIT, next state RTR, local GID index 3, local GID ::ffff:10.0.1.1,"
        " remote GID ::ffff:10.0.3.2\n"
        "spark-1:2201:2250 [0] NCCL INFO transport/net.cc:889 -> 2\n"
        "spark-1:2201:2201 [0] NCCL INFO init.cc:1527 -> 2\n"
        "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:3690, unhandled"
        " system error (run with NCCL_DEBUG=INFO for details), NCCL version 2.28.9\n"
        "ncclSystemError: System call (e.g. socket, malloc) or external library call failed or"
        " device error.\n"
    )
    log = parse_log(text)
    assert log.channels == [] and log.results == []
    assert any("NCCL WARN NET/IB : ibv_modify_qp failed" in e for e in log.errors)
    assert any(e.startswith("ncclSystemError:") for e in log.errors)
    lines = failures(log, Expectations("NET/IB", 20.88))
    assert lines[0].startswith("error: [2026-11-30 21:02:11] spark-1:2201:2250")
    assert "error: ncclSystemError: System call (e.g. socket, malloc)" in lines[2]
    assert "busbw: no all-reduce result (the sweep did not run to its end)" in lines


def test_the_ring_env_on_a_host_without_roce_fails_with_ncclwarn():
    log = parse_log(fixture("nccltests-netib-missing.log"))
    lines = failures(log, expectations_for(load_profile("tp3-ring")))
    assert lines[0].endswith("NCCL WARN Failed to initialize any NET plugin")
    assert any("Test NCCL failure" in line for line in lines)


def test_a_missing_hca_is_named_with_what_the_host_listed():
    three = IB_USING.replace(" [3]roceP2p1s0f1:1/RoCE", "")
    log = parse_log(ib_ring_log(using=three))
    assert log.ib_devices == {"spark-1": dict(enumerate(RING_HCAS[:3]))}
    [line] = failures(log, Expectations("NET/IB", None, RING_HCAS))
    assert line == (
        "HCA: spark-1 lists rocep1s0f0,rocep1s0f1,roceP2p1s0f0, not roceP2p1s0f1; expected all"
        " of rocep1s0f0,rocep1s0f1,roceP2p1s0f0,roceP2p1s0f1"
    )


def test_benign_timeout_settings_are_not_errors():
    log = parse_log(
        "spark-1:1:1 [0] NCCL INFO NCCL_IB_TIMEOUT set by environment to 22\n"
        "spark-1:1:1 [0] NCCL INFO Bootstrap timings total 0.001 (create 0.000, send 0.000)\n"
    )
    assert log.errors == []


@pytest.mark.parametrize("text", ["IB>=20", "P2P>=fast", "NET/IB>=", ""])
def test_a_malformed_expectation_is_one_line_naming_the_form(text):
    with pytest.raises(FabricError, match=r"expected TRANSPORT\[>=GBPS\]\[:HCA,...\]"):
        parse_expectation(text)


# --- rendered through the render stage: Jobs (tp3-ring) and launch plans (tp4-ring) ---

VLLM = "ghcr.io/lab/sparkforge/vllm-gb10-dsv41-exl3@sha256:" + "c" * 64
SGLANG = "ghcr.io/lab/sparkforge/sglang-gb10-dsv41@sha256:" + "d" * 64


def rendered(name: str, image: str) -> list[Document]:
    """A ring's documents as the render step makes them, fabric check included."""
    profile = load_profile(name)
    inputs = RenderInputs(
        load_lock(lock_path(profile.model.lock)),
        image,
        PATCH_SOURCE.read_text(),
        profile.node_weights_root,
    )
    render = (
        render_fabric.kubernetes_with_fabric
        if name == "tp3-ring"
        else render_fabric.docker_with_fabric
    )
    return render(profile, inputs, [])


def fabric_only(docs: list[Document]) -> list[Document]:
    """The fabric check's documents among a render's."""
    return [d for d in docs if d.file.startswith("fabric-")]


def test_tp3_ring_fabric_jobs_run_the_probe_per_member_with_the_service_env_and_pass_validation():
    docs = rendered("tp3-ring", VLLM)
    fabric = fabric_only(docs)
    assert [d.file for d in fabric] == [
        "fabric-configmap-dsv41-flash-fabric-probe.yaml",
        *(f"fabric-job-dsv41-flash-fabric-{rank}.yaml" for rank in range(3)),
    ]
    assert validate_documents(fabric, secrets=[]) == []
    assert render_fabric.check_fabric(docs) == []
    [kustomization] = [d.body for d in docs if d.file == "kustomization.yaml"]
    assert not any(f.startswith("fabric-") for f in kustomization["resources"])  # deploy skips them
    [svc] = [d.body for d in docs if d.body.get("kind") == "InferenceService"]
    service_nccl = {e["name"]: e["value"] for e in svc["spec"]["env"] if "NCCL" in e["name"]}
    assert FABRIC_PROBE.read_text() == fabric[0].body["data"]["probe.py"]
    for rank, job in enumerate(d.body for d in fabric[1:]):
        pod = job["spec"]["template"]["spec"]
        assert pod["nodeName"] == f"spark-{rank + 1}" and pod["hostNetwork"] is True
        [container] = pod["containers"]
        assert container["image"] == VLLM
        assert container["command"][:2] == ["python3", "/opt/sparkforge/fabric/probe.py"]
        env = {e["name"]: e["value"] for e in container["env"]}
        assert {k: v for k, v in env.items() if k in service_nccl} == service_nccl
        assert env["NCCL_IB_SUBNET_AWARE_ROUTING"] == "1"  # the odd ring's routing
        assert env["NCCL_IB_HCA"] == ",".join(RING_HCAS)
        assert env["NCCL_DEBUG"] == "INFO" and env["NCCL_DEBUG_SUBSYS"] == "INIT,NET"
        assert (env["RANK"], env["WORLD_SIZE"]) == (str(rank), "3")
        assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("192.168.100.11", "29600")
        assert "nvidia.com/gpu" not in container["resources"]["limits"]


def test_tp4_ring_fabric_plans_are_the_server_plans_running_the_probe():
    docs = rendered("tp4-ring", SGLANG)
    fabric = fabric_only(docs)
    servers = [d for d in docs if d.file.startswith("launch-")]
    assert [d.file for d in fabric] == [f"fabric-{d.file}" for d in servers]
    assert render_fabric.check_fabric(docs) == []
    for server, plan in zip((d.body for d in servers), (d.body for d in fabric), strict=True):
        assert plan["image"] == SGLANG and plan["network_mode"] == "host"
        assert {k: plan["env"][k] for k in server["env"]} == server["env"]
        assert plan["env"]["MASTER_ADDR"] == "192.168.100.21"
        assert plan["env"]["RANK"] == str(server["rank"])
        assert [m["target"] for m in plan["mounts"]] == [
            m["target"] for m in server["mounts"] if m["target"] != "/models"
        ]
        assert plan["files"] == {"/opt/sparkforge/fabric/probe.py": FABRIC_PROBE.read_text()}


def broken_job(edit) -> list[Document]:
    """tp3-ring's documents with one edit to the first fabric Job."""
    docs = copy.deepcopy(rendered("tp3-ring", VLLM))
    job = next(d for d in docs if d.file.startswith("fabric-job-"))
    edit(job.body["spec"]["template"]["spec"])
    return docs


def drop_env(name: str):
    """An edit removing one env variable from a Job's container."""

    def edit(pod: dict) -> None:
        env = pod["containers"][0]["env"]
        env[:] = [e for e in env if e["name"] != name]

    return edit


@pytest.mark.parametrize(
    ("edit", "line"),
    [
        (
            drop_env("NCCL_IB_SUBNET_AWARE_ROUTING"),
            "spec.template.spec.containers.0.env: NCCL env must be the service's"
            " (found 'NCCL_IB_SUBNET_AWARE_ROUTING')",
        ),
        (
            lambda pod: pod.pop("hostNetwork"),
            "spec.template.spec: must run on the host network",
        ),
        (
            lambda pod: pod["containers"][0].update(image=SGLANG),
            "spec.template.spec.containers.0.image: must be the service's image",
        ),
    ],
)
def test_a_fabric_job_that_differs_from_its_service_is_refused(edit, line):
    lines = render_fabric.check_fabric(broken_job(edit))
    assert len(lines) == 1 and line in lines[0]
    assert lines[0].startswith("fabric-job-dsv41-flash-fabric-0.yaml: ")


def test_a_fabric_job_with_an_unknown_field_is_refused_by_the_kubernetes_schema():
    docs = broken_job(lambda pod: pod["containers"][0].update(bogus=1))
    [line] = validate_documents(fabric_only(docs), secrets=[])
    assert line.startswith("fabric-job-dsv41-flash-fabric-0.yaml: spec.template.spec.containers.0")


def test_a_fabric_plan_without_the_servers_nccl_library_is_refused():
    docs = copy.deepcopy(rendered("tp4-ring", SGLANG))
    plan = next(d for d in docs if d.file.startswith("fabric-launch-2"))
    plan.body["mounts"] = []
    [line] = render_fabric.check_fabric(docs)
    assert line.startswith("fabric-launch-2-spark-3.yaml: mounts: must mount the server's NCCL")


def test_a_fabric_plan_without_nccl_debug_is_refused():
    docs = copy.deepcopy(rendered("tp4-ring", SGLANG))
    plan = next(d for d in docs if d.file.startswith("fabric-launch-1"))
    del plan.body["env"]["NCCL_DEBUG_SUBSYS"]  # the server's plan does not set it
    [line] = render_fabric.check_fabric(docs)
    assert line.startswith("fabric-launch-1-spark-2.yaml: env: needs NCCL_DEBUG=INFO NCCL_DEBUG")


# --- the stage: one result with provenance, one line per failure, the bench's verdict ---


class Replay:
    """A launcher that replays real logs for each rendered member (the ring is not here)."""

    def __init__(self, log: str, status: int | None = 0):
        self.log, self.status, self.docs = log, status, []

    def run(self, docs, timeout_s):
        self.docs = docs
        members = [d for d in docs if d.get("kind") != "ConfigMap"]
        return [
            MemberRun(rank, doc.get("node", f"spark-{rank + 1}"), self.status, self.log)
            for rank, doc in enumerate(members)
        ]

    def strays(self, docs):
        return []  # nothing was applied: nothing an earlier render left

    def prune(self, strays):
        return []


def fabric_stage(
    tmp_path: Path, name: str, replay, expect: str = "", timeout_s: float = 900
) -> Fabric:
    """The fabric stage of a ring profile as dodo wires it; replay: a Replay or a factory."""
    profile = load_profile(name)
    engine = Engine(Store(tmp_path / "store"), root=REPO)
    image = SGLANG if name == "tp4-ring" else VLLM
    render = stages.render_stage(profile, engine, image)
    engine.run(render.step)
    stage = Fabric(
        stages.context(profile, engine, expect=expect), render=render.step, live=lambda: None
    )
    launcher = replay if callable(replay) else (lambda profile, settings: replay)
    stage.settings = dataclasses.replace(stage.settings, launcher=launcher, timeout_s=timeout_s)
    return stage


def test_a_socket_fallback_fails_the_check_in_lines_and_keeps_one_result_with_provenance(
    tmp_path,
):
    replay = Replay(fixture("nccltests-socket.log"))
    stage = fabric_stage(tmp_path, "tp4-ring", replay)
    with pytest.raises(FabricError) as failed:
        stage.check()
    lines = str(failed.value).splitlines()
    assert lines[0].startswith("fabric: transport: 32 of 32 channel connections via NET/Socket")
    assert "(2.93 GB/s busbw at 1073741824 bytes)" in lines[0]
    assert [d["rank"] for d in replay.docs] == [0, 1, 2, 3]  # the four rendered launch plans
    assert all(d["command"][1] == "/opt/sparkforge/fabric/probe.py" for d in replay.docs)
    [path] = (tmp_path / "store" / "fabric" / "tp4-ring").glob("*.json")
    result = json.loads(path.read_text())
    assert result["outcome"] == "failed"
    assert result["failures"] == [line.removeprefix("fabric: ") for line in lines]
    assert result["image"] == SGLANG
    assert result["render_key"] == stage.engine.key(stage.render)
    assert [(m["rank"], m["node"], m["address"]) for m in result["members"]] == [
        (r, f"spark-{r + 1}", f"192.168.100.2{r + 1}") for r in range(4)
    ]
    assert result["measured"]["transports"] == {"NET/Socket": 32}
    assert result["measured"]["largest"]["busbw"] == 2.93
    assert result["expectations"]["transport"] == "NET/IB"
    assert len(list(path.parent.glob(f"{path.stem}-*.log"))) == 4  # each member's raw log
    verdict = fabric_verdict(stage.engine.store, "tp4-ring", None)
    assert verdict.passed is False and verdict.when is not None
    assert "failed: transport: 32 of 32" in fabric_refusal(stage.engine.store, "tp4-ring", None)


def test_a_passing_check_lets_the_bench_start_until_a_newer_deployment(tmp_path):
    stage = fabric_stage(tmp_path, "tp3-ring", Replay(fixture("torch-p2p.log")), "P2P>=200")
    store = stage.engine.store
    assert fabric_verdict(store, "tp3-ring", None) == (False, None)
    stage.check()
    passed, when = fabric_verdict(store, "tp3-ring", None)
    assert passed is True and when is not None
    # The live deployment as deploy publishes it (Deploy.live_record): newer than the check.
    key = stage.engine.key(stage.render)
    live = {"outcome": "deployed", "deployment": {"key": key}, "time_ns": time.time_ns()}
    assert fabric_verdict(store, "tp3-ring", live).passed is False
    assert "is older than the deployment" in fabric_refusal(store, "tp3-ring", live)
    stage.check()
    assert fabric_verdict(store, "tp3-ring", live).passed is True
    other = {**live, "deployment": {"key": "f" * 64}}
    assert "ran documents rendered for" in fabric_refusal(store, "tp3-ring", other)
    # Deploy's own files are not the fabric's to read: only what deploy publishes counts.
    deployments = store.area("deployments") / "tp3-ring"
    deployments.mkdir(parents=True)
    (deployments / f"{time.time_ns()}.json").write_text(json.dumps({**other, "time_ns": 0}))
    assert fabric_verdict(store, "tp3-ring", live).passed is True


def test_deploys_published_live_record_is_the_newest_running_one_with_its_time(tmp_path):
    from pipelines.stages.deploy.records import Records

    records = Records(tmp_path / "deployments" / "tp3-ring")
    first = records.write({"outcome": "deployed", "deployment": {"key": "a" * 64}})
    records.write({"outcome": "rolled back", "deployment": {"key": "b" * 64}})
    (live,) = records.live()
    assert (live["deployment"]["key"], live["time_ns"]) == ("a" * 64, int(first.stem))


def test_a_member_that_does_not_finish_is_a_failure_line(tmp_path):
    replay = Replay(fixture("torch-p2p.log"), status=None)
    stage = fabric_stage(tmp_path, "tp3-ring", replay, "P2P>=200")
    with pytest.raises(FabricError, match="fabric: member spark-2: did not finish in 900 s"):
        stage.check()


# --- the Docker launcher on the local stack's two engines (one over ssh://) ---


# The labels every fabric container of local-ring carries (written out, as `docker ps` shows them).
LABELLED = {"label": ["dev.sparkforge.profile=local-ring", "dev.sparkforge.part=fabric"]}


def busybox_image(client, tag: str) -> str:
    """A one-binary image (a static busybox) built on an engine; returns its tag."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        dockerfile = b"FROM scratch\nCOPY busybox /bin/busybox\n"
        info = tarfile.TarInfo("Dockerfile")
        info.size = len(dockerfile)
        tar.addfile(info, io.BytesIO(dockerfile))
        tar.add("/bin/busybox", "busybox")
    buffer.seek(0)
    client.images.build(fileobj=buffer, custom_context=True, tag=tag, rm=True)
    return tag


def test_the_docker_launcher_runs_a_container_per_member_on_each_engine_then_removes_them(stack):
    local_stack.export_ssh_environment()
    profile = load_profile("local-ring")
    engines = DockerEngines(profile, stack.docker_hosts)
    launcher = DockerLauncher(profile, engines)
    tag = "sparkforge-test/fabric-busybox:1"
    clients = [
        engines.client(MemberHost(rank, m.node, url))
        for rank, (m, url) in enumerate(zip(profile.members, engines.engines(), strict=True))
    ]
    for client in clients:
        busybox_image(client, tag)
    script = "echo rank=$RANK; /bin/busybox cat /opt/sparkforge/fabric/run.log; exit $CODE"
    plans = [
        {
            "rank": rank,
            "node": member.node,
            "image": tag,
            "network_mode": "host",
            "env": {"RANK": str(rank), "CODE": str(3 * rank)},
            "command": ["/bin/busybox", "sh", "-c", script],
            "files": {
                "/opt/sparkforge/fabric/probe.py": "# the probe\n",
                "/opt/sparkforge/fabric/run.log": fixture("torch-socket.log"),
            },
        }
        for rank, member in enumerate(profile.members)
    ]
    try:
        runs = launcher.run(plans, 60)
        left = [x.name for cl in clients for x in cl.containers.list(all=True, filters=LABELLED)]
    finally:
        for client in clients:  # the engines are shared with the other tests: leave no image
            with contextlib.suppress(docker.errors.DockerException):
                client.images.remove(tag, force=True)
        launcher.close()
    assert left == []
    assert [(r.rank, r.node, r.status) for r in runs] == [
        (0, profile.members[0].node, 0),
        (1, profile.members[1].node, 3),
    ]
    assert runs[1].log.startswith("rank=1\n")
    log = parse_log(runs[0].log)
    assert log.transports == {"NET/Socket"} and log.largest.busbw == pytest.approx(2.854)


def test_tp4_ring_expects_net_ib_and_its_hcas_without_a_floor_until_measured():
    assert expectations_for(load_profile("tp4-ring")) == Expectations("NET/IB", None, RING_HCAS)


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (("  transport: NET/IB\n", "  transport: RDMA\n"), "fabric.transport"),
        (("  min_busbw_gbs: 20.88\n", "  min_busbw_gbs: 0\n"), "fabric.min_busbw_gbs"),
    ],
)
def test_a_bad_fabric_expectation_in_a_profile_is_one_line_naming_the_field(tmp_path, edit, field):
    text = (PROFILES_DIR / "tp3-ring.yaml").read_text()
    assert edit[0] in text
    (tmp_path / "tp3-ring.yaml").write_text(text.replace(*edit))
    with pytest.raises(ProfileError) as refused:
        load_profile("tp3-ring", tmp_path)
    assert len(str(refused.value).splitlines()) == 1
    assert field in str(refused.value)


def test_a_profile_without_a_fabric_has_no_fabric_check():
    with pytest.raises(FabricError, match="profile local: field 'fabric': required"):
        expectations_for(load_profile("local"))


def test_saved_logs_are_checked_by_hand_with_a_profile_or_an_expectation():
    def check(*args: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "pipelines.stages.fabric.check", *args]
        return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60)

    nvlink = check(str(NCCL / "nccltests-p2p.log"), "--expect", "P2P>=200")
    assert nvlink.returncode == 0, nvlink.stderr
    assert nvlink.stdout.splitlines() == [
        "fabric: P2P; 328.17 GB/s at 1073741824 bytes",
        "fabric: passed (P2P)",
    ]
    ring = check(str(NCCL / "torch-socket.log"), "--profile", "tp3-ring")
    assert ring.returncode == 1
    assert "fabric: transport: 8 of 8 channel connections via NET/Socket (2.85" in ring.stdout
    assert ring.stdout.splitlines()[-1] == "fabric: failed (NET/IB)"
    unknown = check(str(NCCL / "torch-socket.log"), "--expect", "RDMA")
    assert unknown.returncode == 2 and unknown.stderr.startswith("error: expectation 'RDMA'")


# What nccl-tests prints when a collective corrupts data: #wrong by printf `%6g` (a million or
# more in exponent form) and the footer's count of checks that found wrong values.
CORRUPTIONS = {
    "wrong": (
        "328.17  328.17       0  3265.49",
        "328.17  328.17  2.68435e+08  3265.49",
        "fabric: results: 2.68435e+08 wrong values at 1073741824 bytes",
    ),
    "out-of-bounds": (
        "# Out of bounds values : 0 OK",
        "# Out of bounds values : 1 FAILED",
        "fabric: error: # Out of bounds values : 1 FAILED",
    ),
    # Not a corruption: a collective of 10 s or more prints its time as `1.2e+07` (getFloatStr);
    # the row must still be read, or the check gates on a smaller size and passes.
    "ten-second row": (
        "3271.95  328.17  328.17       0",
        "1.2e+07    0.09    0.09       0",
        "fabric: busbw: 0.09 GB/s busbw at 1073741824 bytes, expected at least 200 GB/s",
    ),
}


@pytest.mark.parametrize("corruption", CORRUPTIONS)
def test_a_run_with_wrong_values_fails_the_check_naming_the_row_or_line(tmp_path, corruption):
    real, corrupt, line = CORRUPTIONS[corruption]
    text = fixture("nccltests-p2p.log")
    assert text.count(real) == 1
    log = tmp_path / "nccltests-p2p.log"
    log.write_text(text.replace(real, corrupt))
    command = [
        sys.executable,
        "-m",
        "pipelines.stages.fabric.check",
        str(log),
        "--expect",
        "P2P>=200",
    ]
    run = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert run.returncode == 1, run.stdout + run.stderr
    assert run.stdout.splitlines()[1:] == [line, "fabric: failed (P2P)"]


def test_the_docker_launcher_prunes_its_profiles_fabric_containers_the_plans_lack_deploy_none(
    stack,
):
    local_stack.export_ssh_environment()
    # A profile of its own: the deploy and fabric tests of local-ring share these engines.
    name = f"fabric-prune-{os.getpid()}"
    profile = msgspec.structs.replace(load_profile("local-ring"), name=name)
    engines = DockerEngines(profile, stack.docker_hosts)
    launcher = DockerLauncher(profile, engines)
    url = engines.engines()[0]
    client = engines.client(MemberHost(0, profile.members[0].node, url))
    tag = busybox_image(client, f"sparkforge-test/fabric-prune-busybox:{os.getpid()}")
    fabric = {"dev.sparkforge.profile": name, "dev.sparkforge.part": "fabric"}
    planted = {
        # a rank the ring no longer has, left by a killed run: the one stray
        f"sparkforge-{name}-fabric-5": fabric,
        # this render's rank 0 (a run in progress): wanted
        f"sparkforge-{name}-fabric-0": fabric,
        # the profile's deployed member: deploy's, not the fabric check's
        f"sparkforge-{name}-5": {"dev.sparkforge.profile": name, "dev.sparkforge.deployment": "k"},
        # another profile's fabric check
        f"sparkforge-{name}x-fabric-1": {**fabric, "dev.sparkforge.profile": f"{name}x"},
    }
    plans = [{"rank": rank, "node": m.node} for rank, m in enumerate(profile.members)]
    try:
        for container, labels in planted.items():
            client.containers.create(tag, ["/bin/busybox", "true"], name=container, labels=labels)
        # The deploy's prune on the same engine, for a deployment of rank 0: the deployed member
        # of rank 5 is its stray, no fabric container is.
        deployed = Deployment(name, "k" * 64, tuple(plans[:1]), tag, (url,))
        hosts = DockerHosts(profile, stack.docker_hosts, timeout_s=5)
        deploys = [s.what for s in hosts.strays(deployed, None)]
        hosts.close()
        strays = launcher.strays(plans)
        failed = launcher.prune(strays)
        # Every container of the shared engine is listed, then inspected one by one: another
        # worker's removed in between is gone, not an error (CI saw that 404 once).
        listed = client.containers.list(all=True, ignore_removed=True)
        left = {c.name for c in listed if c.name in planted}
    finally:
        for container in planted:
            with contextlib.suppress(docker.errors.DockerException):
                client.containers.get(container).remove(force=True)
        with contextlib.suppress(docker.errors.DockerException):
            client.images.remove(tag, force=True)
        launcher.close()
    assert deploys == [f"container sparkforge-{name}-5 on {url}"]
    assert [s.what for s in strays] == [f"container sparkforge-{name}-fabric-5 on {url}"]
    assert strays[0].entry == {
        "engine": url,
        "container": f"sparkforge-{name}-fabric-5",
        "image": tag,
    }
    assert failed == []
    assert left == set(planted) - {f"sparkforge-{name}-fabric-5"}


# --- the Kubernetes launcher against the API double (tests/kube_api.py), not a cluster ---


def test_the_kubernetes_launcher_applies_a_job_per_member_reads_logs_and_deletes_them(tmp_path):
    double = KubeDouble()
    double.add({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "dsv41"}})
    earlier = {"apiVersion": "batch/v1", "kind": "Job"}
    earlier["metadata"] = {"name": "dsv41-flash-fabric-0", "namespace": "dsv41"}
    double.add(earlier)  # left by an interrupted check: its template cannot change
    for rank in range(3):
        double.logs[f"dsv41-flash-fabric-{rank}"] = fixture("torch-socket.log")
    failed = [job_status("Running"), job_status("Failed", "BackoffLimitExceeded")]
    double.script("Job", "dsv41-flash-fabric-2", failed)
    server = KubeServer(double)
    try:
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(yaml.safe_dump(server.kubeconfig()))
        access = KubeAccess(str(kubeconfig), poll_s=0.001)
        launcher = lambda p, s: KubernetesLauncher(p, access)  # noqa: E731
        stage = fabric_stage(tmp_path, "tp3-ring", launcher, timeout_s=10)
        with pytest.raises(FabricError) as refused:
            stage.check()
    finally:
        server.close()
    lines = str(refused.value).splitlines()
    assert lines[0].startswith("fabric: transport: 24 of 24 channel connections via NET/Socket")
    assert lines[-1] == "fabric: member spark-3: the probe exited with status 1"
    jobs = [f"Job/dsv41-flash-fabric-{rank}" for rank in range(3)]
    assert double.applied() == [
        "apply ConfigMap/dsv41-flash-fabric-probe",
        f"delete {jobs[0]}",
        *(f"apply {job}" for job in jobs),
        *(f"delete {job}" for job in jobs),
    ]
    [path] = (tmp_path / "store" / "fabric" / "tp3-ring").glob("*.json")
    result = json.loads(path.read_text())
    assert [m["status"] for m in result["members"]] == [0, 0, 1]
    assert result["image"] == VLLM
