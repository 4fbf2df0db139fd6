"""Render and validate: tp3-ring manifests, tp4-ring launch plans, and what must never pass."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipelines.errors import PipelineError
from pipelines.launch import launch_plans
from pipelines.manifests import render_step
from pipelines.profiles import PROFILES_DIR, load_profile
from pipelines.render import Document, render_kubernetes
from pipelines.steps import Engine
from pipelines.store import Store
from pipelines.validate import (
    ROCE_DEVICES,
    check_operator_rules,
    check_schema,
    validate_documents,
)
from pipelines.weights.lock import load_lock, lock_path

REPO = Path(__file__).resolve().parent.parent
IMAGE = "ghcr.io/lab/sparkforge/vllm-gb10-dsv41-exl3@sha256:" + "c" * 64
SGLANG = "ghcr.io/lab/sparkforge/sglang-gb10-dsv41@sha256:" + "d" * 64


def docs_by_kind(docs: list[Document], kind: str) -> list[dict]:
    """Bodies of the documents of one kind."""
    return [d.body for d in docs if d.body.get("kind") == kind]


def tp3_docs() -> list[Document]:
    """The tp3-ring documents rendered with a pinned image."""
    profile = load_profile("tp3-ring")
    return render_kubernetes(profile, load_lock(lock_path(profile.model.lock)), IMAGE)


def test_tp3_ring_renders_the_domain_facts():
    docs = tp3_docs()
    assert validate_documents(docs, secrets=[]) == []
    [svc] = docs_by_kind(docs, "InferenceService")
    spec = svc["spec"]
    members = spec["multiNode"]["members"]
    assert [m["node"] for m in members] == ["spark-1", "spark-2", "spark-3"]
    assert spec["vllmConfig"]["tensorParallelSize"] == 3
    assert spec["vllmConfig"]["gpuMemoryUtilization"] == 0.78
    env = {e["name"]: e["value"] for e in spec["env"]}
    assert env["NCCL_IB_SUBNET_AWARE_ROUTING"] == "1"
    assert env["MAX_JOBS"] == "1"
    assert env["CUDA_EXL3_MODEL_PATH"] == "/models/22fa141368a3262a"
    assert all(m["fabric"]["ibHCA"].split(",") == list(ROCE_DEVICES) for m in members)
    assert members[0]["fabric"]["address"] == "192.168.100.11"  # management plane, not RoCE
    assert spec["image"] == IMAGE
    assert spec["multiNode"]["rdmaResource"] == "rdma/rdma_shared_device_a"
    assert spec["multiNode"]["ibGIDIndex"] == 3
    assert not any("--hf-overrides" in a or "--quantization" in a for a in spec["extraArgs"])
    [model] = docs_by_kind(docs, "Model")
    assert len(model["spec"]["files"]) == 54
    assert model["spec"]["sourceSecretRef"] == {"name": "dsv41-model-source"}
    assert (
        model["spec"]["source"] == "s3://models/bot-lab-21/DeepSeek-V4.1-Flash-EXL3-3.5bpw-Pollard"
    )
    files = [d.file for d in docs]
    patch_jobs = [f for f in files if "tp3-patch-" in f and f.startswith("40-job")]
    assert len(patch_jobs) == 3
    assert max(files.index(f) for f in patch_jobs) < files.index(
        "60-inferenceservice-dsv41-flash.yaml"
    )
    job = next(d.body for d in docs if d.file == patch_jobs[0])
    command = job["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command == ["python3", "/opt/sparkforge/patch.py", "/models/22fa141368a3262a"]


BROKEN = {
    "four members at TP3": (
        "- {node: spark-3,",
        "- {node: spark-4, address: 192.168.100.14,"
        " socket_interface: enP7s7, claim: c4}\n  - {node: spark-3,",
    ),
    "a member without an address": ("{node: spark-2, address: 192.168.100.12,", "{node: spark-2,"),
    "gpuMemoryUtilization 0.72": ("gpu_memory_utilization: 0.78", "gpu_memory_utilization: 0.72"),
    "gpuMemoryUtilization 1.5": ("gpu_memory_utilization: 0.78", "gpu_memory_utilization: 1.5"),
    "three RoCE devices": ("roceP2p1s0f0, roceP2p1s0f1]", "roceP2p1s0f0]"),
    "a misspelled field": ("  rdma_resource:", "  rdma_resorce:"),
    "routing turned off on an odd ring": ("env:\n", 'env:\n  NCCL_IB_SUBNET_AWARE_ROUTING: "0"\n'),
    "no TP3 patch": ("config_patch: tp3-heads", "config_patch: none"),
    "a member without a claim": (", claim: dsv41-cache-spark-3}", "}"),
    "pipeline parallel 2": (
        "parallel: {tensor: 3, pipeline: 1}",
        "parallel: {tensor: 3, pipeline: 2}",
    ),
    "memory in GB": ("memory: 110Gi", "memory: 110GB"),
    "a secret in the env": ("env:\n", 'env:\n  LEAKED: "s3cr3t-value-123"\n'),
    "rendezvous port out of range": ("rendezvous_port: 29500", "rendezvous_port: 70000"),
    "a --quantization argument": ("- --enable-auto-tool-choice", "- --quantization=exl3"),
    "no hygiene section": ("hygiene: {", "unused: {"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_profile_fails_with_one_line_per_violation_and_writes_nothing(
    case, tmp_path, monkeypatch
):
    # The secret the "secret in the env" case leaks, as the real step finds it: by its name.
    monkeypatch.setenv("SPARKFORGE_TEST_SECRET_TOKEN", "s3cr3t-value-123")
    old, new = BROKEN[case]
    text = (PROFILES_DIR / "tp3-ring.yaml").read_text()
    assert old in text, case
    folder = tmp_path / "profiles"
    folder.mkdir()
    (folder / "tp3-ring.yaml").write_text(text.replace(old, new, 1))
    store = Store(tmp_path / "store")
    with pytest.raises(PipelineError) as err:
        profile = load_profile("tp3-ring", folder)
        Engine(store, root=REPO).run(render_step(profile, lambda: IMAGE))
    lines = str(err.value).splitlines()
    assert lines and all(line.count(": ") >= 2 for line in lines), lines
    assert "s3cr3t-value-123" not in str(err.value)
    assert not list((store.root / "steps").iterdir())
    assert not list((store.root / "tmp").iterdir())


def test_each_violation_names_document_path_rule_and_value():
    docs = tp3_docs()
    svc = next(d for d in docs if d.body["kind"] == "InferenceService")
    bad = copy.deepcopy(svc.body)
    bad["spec"]["vllmConfig"]["gpuMemoryUtilization"] = 0.05
    bad["spec"]["replicas"] = 2
    bad["spec"]["image"] = "vllm/vllm-openai:latest"
    broken = Document(svc.file, bad)
    schema = check_schema(broken)
    assert (
        "60-inferenceservice-dsv41-flash.yaml: spec.image: 'vllm/vllm-openai:latest' does not match"
        in schema[0]
    )
    assert any(
        line.startswith(
            "60-inferenceservice-dsv41-flash.yaml: spec.vllmConfig.gpuMemoryUtilization:"
        )
        and line.endswith("(found 0.05)")
        for line in schema
    )
    assert check_operator_rules(broken) == [
        "60-inferenceservice-dsv41-flash.yaml: spec.replicas: must be 1 or unset with multiNode"
        " (found 2)"
    ]
    job = next(d for d in docs if d.body["kind"] == "Job")
    odd = copy.deepcopy(job.body)
    odd["spec"]["template"]["spec"]["containers"][0]["bogus"] = 1
    [line] = check_schema(Document(job.file, odd))
    assert line.startswith(f"{job.file}: spec.template.spec.containers.0: Additional properties")


def test_rendering_twice_is_byte_identical_and_one_change_touches_only_its_documents(tmp_path):
    profile = load_profile("tp3-ring")
    outputs = []
    for n, value in enumerate((0.78, 0.78, 0.8)):
        changed = profile.model_copy(
            update={"vllm": profile.vllm.model_copy(update={"gpu_memory_utilization": value})}
        )
        engine = Engine(Store(tmp_path / f"store{n}"), root=REPO)
        step = render_step(changed, lambda: IMAGE)
        out = engine.run(step)
        outputs.append((engine.key(step), {p.name: p.read_bytes() for p in out.iterdir()}))
    (key1, files1), (key2, files2), (key3, files3) = outputs
    assert key1 == key2 and files1 == files2
    assert key3 != key1
    assert {name for name in files1 if files1[name] != files3[name]} == {
        "60-inferenceservice-dsv41-flash.yaml"
    }


def test_tp4_ring_gives_four_launch_plans_with_the_ring_env():
    profile = load_profile("tp4-ring")
    plans = launch_plans(profile, SGLANG, "/var/lib/sparkforge/weights/models/x")
    assert len(plans) == 4
    expected = {
        "NCCL_NET": "IB",
        "NCCL_IB_DISABLE": "0",
        "NCCL_IB_GID_INDEX": "3",
        "NCCL_CUMEM_ENABLE": "0",
        "NCCL_IB_HCA": ",".join(ROCE_DEVICES),
        "NCCL_IB_MERGE_NICS": "0",
        "NCCL_IB_SUBNET_AWARE_ROUTING": "1",
        "NCCL_IB_SUBNET_PREFIX_LEN": "24",
        "NCCL_CROSS_NIC": "1",
        "NCCL_ALGO": "Ring",
        "NCCL_MIN_NCHANNELS": "4",
        "NCCL_P2P_LEVEL": "SYS",
        "NCCL_SOCKET_IFNAME": "enP7s7",
        "NCCL_SWITCHLESS_RING_ONLY": "1",
    }
    for rank, plan in enumerate(p.body for p in plans):
        assert plan["env"] == expected
        assert plan["image"] == SGLANG and plan["network_mode"] == "host"
        command = plan["command"]
        flag = dict(zip(command[3::2], command[4::2], strict=False))
        assert flag["--node-rank"] == str(rank)
        assert flag["--context-length"] == "1048576"
        assert flag["--max-running-requests"] == "8"
        assert flag["--max-total-tokens"] == "8000000"
        assert flag["--mem-fraction-static"] == "0.80"
        assert flag["--chunked-prefill-size"] == "1024"
        overlay = next(m for m in plan["mounts"] if m["source"].endswith("libnccl.so.2"))
        assert overlay["target"].endswith("nvidia/nccl/lib/libnccl.so.2")


def test_doit_render_prints_the_documents_and_a_second_run_does_nothing(tmp_path):
    env = {**os.environ, "SPARKFORGE_STORE": str(tmp_path / "store")}
    args = [
        sys.executable,
        "-m",
        "doit",
        "render",
        "profile=tp3-ring",
        "image_digest=sha256:" + "e" * 64,
    ]
    first = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr + first.stdout
    assert "60-inferenceservice-dsv41-flash.yaml" in first.stdout
    assert "kustomization.yaml" in first.stdout
    second = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True)
    assert "-- render" in second.stdout
