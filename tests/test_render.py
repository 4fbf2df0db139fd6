"""Render and validate: tp3-ring manifests, tp4-ring launch plans, and what must never pass."""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from staged_tp3 import staged_tp3_render
from support import stages
from support.doit import run_doit

from pipelines.core.errors import PipelineError
from pipelines.core.modellock import load_lock, lock_path
from pipelines.core.paths import PATCH_SOURCE, PROFILES_DIR, RENDER_DIR
from pipelines.core.profiles import ProfileError, load_profile, parse_profile
from pipelines.core.schema import replace
from pipelines.engine.steps import Engine
from pipelines.engine.store import Store
from pipelines.stages.render import Render
from pipelines.stages.render.crd_schema import apply_overlay
from pipelines.stages.render.docker import launch_plans
from pipelines.stages.render.documents import Document, RenderError, write_documents
from pipelines.stages.render.kubernetes import render_kubernetes
from pipelines.stages.render.validate import (
    ROCE_DEVICES,
    check_operator_rules,
    check_schema,
    validate_documents,
    violation,
)
from pipelines.targets import renderer_for

REPO = Path(__file__).resolve().parent.parent
IMAGE = "ghcr.io/lab/sparkforge/vllm-gb10-dsv41-exl3@sha256:" + "c" * 64
SGLANG = "ghcr.io/lab/sparkforge/sglang-gb10-dsv41@sha256:" + "d" * 64


def docs_by_kind(docs: list[Document], kind: str) -> list[dict]:
    """Bodies of the documents of one kind."""
    return [d.body for d in docs if d.body.get("kind") == kind]


def render_stage(profile, store_root: Path, image: str = IMAGE, secrets=()) -> Render:
    """The render stage of a profile as dodo wires it: weights' published outputs, an image."""
    return stages.render_stage(profile, Engine(Store(store_root), root=REPO), image, secrets)


def tp3_docs() -> list[Document]:
    """The tp3-ring documents rendered with a pinned image."""
    profile = load_profile("tp3-ring")
    lock = load_lock(lock_path(profile.model.lock))
    return render_kubernetes(profile, lock, IMAGE, PATCH_SOURCE.read_text())


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


# Profiles the loader accepts but the validator must refuse: (edit, the rule that must fire).
BROKEN = {
    "gpuMemoryUtilization 0.72": (
        ("gpu_memory_utilization: 0.78", "gpu_memory_utilization: 0.72"),
        "spec.vllmConfig.gpuMemoryUtilization: at TP3 must be at least 0.78",
    ),
    "three RoCE devices": (
        ("roceP2p1s0f0, roceP2p1s0f1]", "roceP2p1s0f0]"),
        "spec.multiNode.members.0.fabric.ibHCA: must list all four RoCE devices",
    ),
    "routing turned off on an odd ring": (
        ("env:\n", 'env:\n  NCCL_IB_SUBNET_AWARE_ROUTING: "0"\n'),
        "spec.env.NCCL_IB_SUBNET_AWARE_ROUTING: an odd ring (3 members) needs 1",
    ),
    "a secret in the env": (
        ("env:\n", 'env:\n  LEAKED: "s3cr3t-value-123"\n'),
        "(document): contains a secret value from the environment",
    ),
}


def edited_profile(tmp_path: Path, old: str, new: str, name: str = "tp3-ring") -> Path:
    """A copy of a shipped profile with one edit, in its own folder."""
    text = (PROFILES_DIR / f"{name}.yaml").read_text()
    assert old in text
    folder = tmp_path / "profiles"
    folder.mkdir(exist_ok=True)
    (folder / f"{name}.yaml").write_text(text.replace(old, new, 1))
    return folder


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_profile_is_refused_by_its_rule_and_writes_nothing(case, tmp_path):
    (old, new), rule = BROKEN[case]
    profile = load_profile("tp3-ring", edited_profile(tmp_path, old, new))
    stage = render_stage(profile, tmp_path / "store", secrets=["s3cr3t-value-123"])
    with pytest.raises(PipelineError) as err:
        stage.engine.run(stage.step)
    lines = str(err.value).splitlines()
    assert any(rule in line for line in lines), lines
    assert all(line.count(": ") >= 2 for line in lines), lines
    assert "s3cr3t-value-123" not in str(err.value)
    store = stage.engine.store
    assert not list((store.root / "steps").iterdir())
    assert not list((store.root / "tmp").iterdir())


def kubernetes_sglang_profile(folder: Path) -> Path:
    """tp4-ring (SGLang) with everything a kubernetes deploy asks for: only the pair is wrong."""
    tp3 = yaml.safe_load((PROFILES_DIR / "tp3-ring.yaml").read_text())
    body = yaml.safe_load((PROFILES_DIR / "tp4-ring.yaml").read_text())
    body.update(name="sparkforge-test-pair", deploy="kubernetes", kubernetes=tp3["kubernetes"])
    body["model"]["source_secret"] = "model-source"
    for i, member in enumerate(body["members"]):
        member["claim"] = f"cache-{i}"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "sparkforge-test-pair.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


def test_a_pair_no_renderer_covers_is_refused_with_one_line(tmp_path):
    profile = parse_profile(kubernetes_sglang_profile(tmp_path))
    with pytest.raises(ProfileError) as err:
        renderer_for(profile)
    [line] = str(err.value).splitlines()
    assert "fields 'deploy' and 'runtime': kubernetes+sglang is not supported" in line


def test_doit_refuses_an_uncovered_pair_when_the_profile_loads(tmp_path):
    path = kubernetes_sglang_profile(PROFILES_DIR)
    try:
        result = run_doit("list", f"profile={path.stem}")
    finally:
        path.unlink()
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert "kubernetes+sglang is not supported" in lines[0]


def test_each_violation_names_document_path_rule_and_value():
    docs = tp3_docs()
    svc = next(d for d in docs if d.body["kind"] == "InferenceService")
    bad = copy.deepcopy(svc.body)
    bad["spec"]["vllmConfig"]["gpuMemoryUtilization"] = 0.05
    bad["spec"]["replicas"] = 2
    bad["spec"]["image"] = "vllm/vllm-openai:latest"
    broken = Document(svc.file, bad)
    schema = check_schema(broken)
    # The real CRD has no image pattern: a tag is layer 3's (policy) to refuse, not layer 1's.
    assert schema == [
        "60-inferenceservice-dsv41-flash.yaml: spec.vllmConfig.gpuMemoryUtilization: 0.05 is"
        " less than the minimum of 0.1 [layer 1 schema, LLMKube@907ac8d8"
        " inference.llmkube.dev_inferenceservices.yaml] (found 0.05)"
    ]
    [line] = check_operator_rules(broken)
    assert line.startswith(f"60-inferenceservice-dsv41-flash.yaml: {REPLICAS_RULE}")
    assert (
        "60-inferenceservice-dsv41-flash.yaml: spec.image: image must be pinned by digest"
        " (found 'vllm/vllm-openai:latest')"
    ) in validate_documents([*docs[:-1], broken], secrets=[])
    job = next(d for d in docs if d.body["kind"] == "Job")
    odd = copy.deepcopy(job.body)
    odd["spec"]["template"]["spec"]["containers"][0]["bogus"] = 1
    [line] = check_schema(Document(job.file, odd))
    assert line.startswith(f"{job.file}: spec.template.spec.containers.0: Additional properties")


def core_cases() -> list[Document]:
    """Every core-kind document tp3-ring renders, and each with a field wrong: an unknown one
    at the top and in its spec, a name that is a number."""
    cases = []
    for doc in tp3_docs():
        if doc.body.get("apiVersion") == "inference.llmkube.dev/v1alpha1":
            continue
        cases.append(doc)
        changes = [{"bogus": 1}, {"metadata": {**doc.body["metadata"], "name": 7}}]
        if isinstance(doc.body.get("spec"), dict):
            changes.append({"spec": {**doc.body["spec"], "bogusField": [None]}})
        cases += [Document(doc.file, {**copy.deepcopy(doc.body), **c}) for c in changes]
    return cases


def test_core_kinds_get_exactly_what_kubernetes_validate_itself_says():
    import kubernetes_validate

    for doc in core_cases():
        try:
            kubernetes_validate.validate(doc.body, "1.33", strict=True)
            expected = []
        except kubernetes_validate.ValidationError as err:
            expected = [violation(doc.file, err.absolute_path, err.message, err.instance)]
        assert check_schema(doc) == expected


def test_a_core_kinds_schema_is_read_once_per_process_not_once_per_document(monkeypatch):
    from kubernetes_validate import utils

    from pipelines.stages.render import core_schema

    reads = []
    real = utils.schema_contents
    monkeypatch.setattr(utils, "schema_contents", lambda n, v: reads.append(n) or real(n, v))
    for cached in (core_schema.schema_folder, core_schema.definitions, core_schema.core_validator):
        cached.cache_clear()
    cases = core_cases()
    for doc in cases * 3:
        check_schema(doc)
    kinds = {(d.body["apiVersion"], d.body["kind"]) for d in cases}
    assert len(cases) * 3 > 2 * len(kinds) + 1
    assert sorted(reads) == sorted({*reads}) and len(reads) == len(kinds) + 1


def test_a_template_is_compiled_once_per_process_and_again_when_its_file_changes(
    tmp_path, monkeypatch
):
    import jinja2

    from pipelines.stages.render.documents import render_template, template_env

    compiled: list[str | None] = []
    real = jinja2.Environment.compile

    def counted(self, source, name=None, filename=None, raw=False, defer_init=False):
        compiled.append(name)
        return real(self, source, name, filename, raw, defer_init)

    monkeypatch.setattr(jinja2.Environment, "compile", counted)
    first = tp3_docs()
    compiled.clear()  # what an earlier test of this worker compiled counts for nothing here
    template_env.cache_clear()
    tp3_docs()
    once = sorted(compiled)
    assert once and once == sorted(set(once))
    again = tp3_docs()
    assert sorted(compiled) == once  # the second render compiled nothing
    assert [d.text() for d in again] == [d.text() for d in first]

    template = tmp_path / "t.yaml.j2"
    template.write_text("key: {{ v | tojson }}\n")
    assert render_template(template_env(tmp_path), "t.yaml.j2", {"v": 1}) == [{"key": 1}]
    template.write_text("other: {{ v | tojson }}\n")
    os.utime(template, ns=(0, 10**9))  # another mtime, whatever the clock's granularity
    assert render_template(template_env(tmp_path), "t.yaml.j2", {"v": 1}) == [{"other": 1}]


def test_a_pyyaml_without_libyaml_is_one_line_not_other_bytes(monkeypatch):
    # PyYAML's own emitter writes some documents with other bytes: no fallback to it.
    monkeypatch.delattr(yaml, "CSafeDumper")
    with pytest.raises(PipelineError) as err:
        Document("a.yaml", {"kind": "ConfigMap"}).text()
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("a.yaml: PyYAML ") and "has no libyaml" in message


def test_rendering_twice_is_byte_identical_and_one_change_touches_only_its_documents(tmp_path):
    profile = load_profile("tp3-ring")
    outputs = []
    for n, value in enumerate((0.78, 0.78, 0.8)):
        changed = replace(profile, vllm=replace(profile.vllm, gpu_memory_utilization=value))
        stage = render_stage(changed, tmp_path / f"store{n}")
        out = stage.engine.run(stage.step)
        key = stage.engine.key(stage.step)
        outputs.append((key, {p.name: p.read_bytes() for p in out.iterdir()}))
    (key1, files1), (key2, files2), (key3, files3) = outputs
    assert key1 == key2 and files1 == files2
    assert key3 != key1
    assert {name for name in files1 if files1[name] != files3[name]} == {
        "60-inferenceservice-dsv41-flash.yaml"
    }


def test_a_change_to_the_renderers_code_changes_the_render_key_and_bytecode_does_not(
    tmp_path, monkeypatch
):
    code = tmp_path / "render"
    shutil.copytree(RENDER_DIR, code, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr("pipelines.stages.render.tasks.RENDER_DIR", code)
    profile = load_profile("tp3-ring")

    def key() -> str:
        stage = render_stage(profile, tmp_path / "store")
        return stage.engine.key(stage.step)

    before = key()
    (code / "__pycache__").mkdir()
    (code / "__pycache__" / "kubernetes.cpython-311.pyc").write_bytes(b"bytecode of this machine")
    assert key() == before
    source = code / "kubernetes.py"
    source.write_text(
        source.read_text().replace('"NCCL_IB_TIMEOUT": "22"', '"NCCL_IB_TIMEOUT": "14"')
    )
    assert key() != before


def test_two_documents_for_one_file_are_refused_and_nothing_is_written(tmp_path):
    first, *rest = tp3_docs()
    twin = Document(first.file, {**first.body, "metadata": {"name": "another"}})
    with pytest.raises(RenderError) as err:
        write_documents([first, *rest, twin], tmp_path)
    assert str(err.value) == f"render: two documents for {first.file}; expected one each"
    assert list(tmp_path.iterdir()) == []


def test_tp4_ring_gives_four_launch_plans_with_the_ring_env():
    profile = load_profile("tp4-ring")
    plans = launch_plans(profile, SGLANG, ["/var/lib/sparkforge/weights/models/x"] * 4)
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
        assert "--enable-metrics" in command  # else SGLang serves no /metrics: no idle check
        overlay = next(m for m in plan["mounts"] if m["source"].endswith("libnccl.so.2"))
        assert overlay["target"].endswith("nvidia/nccl/lib/libnccl.so.2")


def test_sglang_extra_args_end_the_command_and_may_not_repeat_a_rendered_option():
    profile = load_profile("tp4-ring")
    parsers = ["--reasoning-parser", "deepseek-v4", "--tool-call-parser=deepseekv4"]
    extra = replace(profile, sglang=replace(profile.sglang, extra_args=parsers))
    plans = launch_plans(extra, SGLANG, ["/var/lib/sparkforge/weights/models/x"] * 4)
    assert all(p.body["command"][-3:] == parsers for p in plans)
    for clash in (["--context_length", "4096"], ["--enable-metrics"], ["--tp=2"]):
        again = replace(profile, sglang=replace(profile.sglang, extra_args=clash))
        with pytest.raises(RenderError) as refused:
            launch_plans(again, SGLANG, ["/m"] * 4)
        assert str(refused.value) == (
            f"profile tp4-ring: field 'sglang.extra_args': {clash[0].split('=')[0]} is set by"
            " the renderer from the profile; expected an option it does not set"
        )


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


def test_a_missing_tp3_patch_job_is_refused_by_the_patch_job_rule():
    docs = tp3_docs()
    without = [d for d in docs if d.file != "40-job-dsv41-flash-tp3-patch-1.yaml"]
    assert len(without) == len(docs) - 1
    found = validate_documents(without, secrets=[])
    assert found == [
        "60-inferenceservice-dsv41-flash.yaml: spec.multiNode.members.1.node: TP3 needs the"
        " padded config: no tp3-patch Job for this member (found 'spark-2')"
    ]


def test_a_patch_job_after_the_service_is_refused_by_the_apply_order_rule():
    docs = tp3_docs()
    job = next(d for d in docs if d.file.startswith("40-job-dsv41-flash-tp3-patch"))
    reordered = [d for d in docs if d is not job] + [job]
    [line] = validate_documents(reordered, secrets=[])
    assert line.startswith(f"{job.file}: metadata.name: the tp3-patch Job must come after")


def test_multinode_with_another_runtime_is_refused_by_the_operator_rule():
    svc = next(d for d in tp3_docs() if d.body["kind"] == "InferenceService")
    body = copy.deepcopy(svc.body)
    body["spec"]["runtime"] = "llamacpp"
    [line] = check_operator_rules(Document(svc.file, body))
    assert line.startswith(f"{svc.file}: {RUNTIME_RULE}")


def test_launch_plans_with_an_unpinned_image_are_refused_and_nothing_is_stored(tmp_path):
    stage = render_stage(load_profile("tp4-ring"), tmp_path / "store", image="lmsysorg/sglang:v1")
    with pytest.raises(PipelineError) as err:
        stage.engine.run(stage.step)
    lines = str(err.value).splitlines()
    assert len(lines) == 4
    assert lines[0] == (
        "launch-0-spark-1.yaml: image: image must be pinned by digest (found 'lmsysorg/sglang:v1')"
    )
    assert not list((stage.engine.store.root / "steps").iterdir())


# --- each rule of the validator, alone, with its exact line ------------------------------------

SERVICE = "60-inferenceservice-dsv41-flash.yaml"
DELETE = object()


def tp3_with(edits: dict) -> list[Document]:
    """The tp3-ring documents with the InferenceService's spec edited: "a.0.b" -> value (or
    DELETE to leave the field out)."""
    docs = []
    for doc in tp3_docs():
        if doc.body["kind"] == "InferenceService":
            body = copy.deepcopy(doc.body)
            for dotted, value in edits.items():
                *parents, last = (int(k) if k.isdigit() else k for k in dotted.split("."))
                node = body["spec"]
                for key in parents:
                    node = node[key]
                if value is DELETE:
                    del node[last]
                else:
                    node[last] = value
            doc = Document(doc.file, body)
        docs.append(doc)
    return docs


PRODUCT_RULE = "spec.vllmConfig.tensorParallelSize: tensorParallelSize x pipelineParallelSize must"
GUARD = " [layer 2 reconcile-time rule, LLMKube PR #1746]"
OVERLAY = " [layer 1 schema, LLMKube PR #1746 overlay]"
CRD_FILE = "LLMKube@907ac8d8 inference.llmkube.dev_inferenceservices.yaml"
CEL = " [layer 2 CEL rule {}, LLMKube PR #1746 overlay] (found "
ADDRESS_RULE = (
    "spec.multiNode: members[0].fabric.address is required: it is the rendezvous address every"
    " other rank dials" + CEL.format("spec.multiNode#0")
)
REPLICAS_RULE = "spec: multiNode serves one group: replicas must be 1 or unset" + CEL.format(
    "spec#0"
)
RUNTIME_RULE = "spec: multiNode is supported for runtime vllm in this release" + CEL.format(
    "spec#1"
)

# Edits of the rendered service, and exactly the lines each must give (layer tags included).
RULES = {
    "rank 0 without a rendezvous address": (
        {"multiNode.members.0.fabric.address": DELETE},
        [ADDRESS_RULE],
    ),
    "rank 0 without its fabric": (
        # The CRD does not require fabric per member: its rule asks rank 0's.
        {"multiNode.members.0.fabric": DELETE},
        [
            ADDRESS_RULE,
            "spec.multiNode.members.0.fabric.ibHCA: must list all four RoCE devices"
            " rocep1s0f0,rocep1s0f1,roceP2p1s0f0,roceP2p1s0f1 (found '')",
        ],
    ),
    "a multiNode without members": (
        {"multiNode.members": DELETE},
        [
            f"spec.multiNode: 'members' is a required property{OVERLAY} (found ",
            # The API server evaluates the rule all the same: it errs on the missing key.
            "spec.multiNode: rule could not be evaluated: no such key: members"
            + CEL.format("spec.multiNode#0"),
            f"{PRODUCT_RULE} equal members x gpu = 0{GUARD} (found 3)",
        ],
    ),
    "an empty member list": (
        {"multiNode.members": []},
        [
            f"spec.multiNode.members: [] is too short{OVERLAY} (found '[]')",
            "spec.multiNode: rule could not be evaluated: index out of bounds: 0"
            + CEL.format("spec.multiNode#0"),
            f"{PRODUCT_RULE} equal members x gpu = 0{GUARD} (found 3)",
        ],
    ),
    "two replicas of a ring": (
        {"replicas": 2},
        [REPLICAS_RULE],
    ),
    "pipeline parallel 2 on three GPUs": (
        {"vllmConfig.pipelineParallelSize": 2},
        [f"{PRODUCT_RULE} equal members x gpu = 3{GUARD} (found 6)"],
    ),
    "tensorParallelSize left out": (
        # Not required by the real CRD (defaults to 1): the guard catches the product.
        {"vllmConfig.tensorParallelSize": DELETE},
        [f"{PRODUCT_RULE} equal members x gpu = 3{GUARD} (found 1)"],
    ),
    "vllmConfig left out": (
        {"vllmConfig": DELETE},
        [f"{PRODUCT_RULE} equal members x gpu = 3{GUARD} (found 1)"],
    ),
    "no GPU count": (
        {"resources.gpu": DELETE},
        [f"{PRODUCT_RULE} equal members x gpu = 0{GUARD} (found 3)"],
    ),
    "no resources": (
        {"resources": DELETE},
        [f"{PRODUCT_RULE} equal members x gpu = 0{GUARD} (found 3)"],
    ),
    "a single node without multiNode": (
        # The single-pod guard: TP3 on the one GPU a pod asks for can never start.
        {"multiNode": DELETE},
        [f"{PRODUCT_RULE} not exceed gpu = 1{GUARD} (found 3)"],
    ),
    "gpuMemoryUtilization 0.72 at TP3": (
        {"vllmConfig.gpuMemoryUtilization": 0.72},
        [
            "spec.vllmConfig.gpuMemoryUtilization: at TP3 must be at least 0.78 (a smaller value"
            " leaves no KV pool) (found 0.72)"
        ],
    ),
    "no env on an odd ring": (
        {"env": DELETE},
        [
            "spec.env.NCCL_IB_SUBNET_AWARE_ROUTING: an odd ring (3 members) needs 1 or NCCL"
            " cannot close the cycle (found None)"
        ],
    ),
    "three RoCE devices on rank 1": (
        {"multiNode.members.1.fabric.ibHCA": "rocep1s0f0,rocep1s0f1,roceP2p1s0f0"},
        [
            "spec.multiNode.members.1.fabric.ibHCA: must list all four RoCE devices"
            " rocep1s0f0,rocep1s0f1,roceP2p1s0f0,roceP2p1s0f1"
            " (found 'rocep1s0f0,rocep1s0f1,roceP2p1s0f0')"
        ],
    ),
    "no ibHCA on rank 1": (
        {"multiNode.members.1.fabric.ibHCA": DELETE},
        [
            "spec.multiNode.members.1.fabric.ibHCA: must list all four RoCE devices"
            " rocep1s0f0,rocep1s0f1,roceP2p1s0f0,roceP2p1s0f1 (found '')"
        ],
    ),
    "routing turned off on an odd ring": (
        {"env": [{"name": "NCCL_IB_SUBNET_AWARE_ROUTING", "value": "0"}]},
        [
            "spec.env.NCCL_IB_SUBNET_AWARE_ROUTING: an odd ring (3 members) needs 1 or NCCL"
            " cannot close the cycle (found '0')"
        ],
    ),
    "a single node asking TP3 alone on one GPU": (
        {"multiNode": DELETE, "vllmConfig.pipelineParallelSize": DELETE},
        [f"{PRODUCT_RULE} not exceed gpu = 1{GUARD} (found 3)"],
    ),
    "a single node asking PP2 alone on one GPU": (
        {
            "multiNode": DELETE,
            "vllmConfig.tensorParallelSize": DELETE,
            "vllmConfig.pipelineParallelSize": 2,
        },
        [f"{PRODUCT_RULE} not exceed gpu = 1{GUARD} (found 2)"],
    ),
    "a latency SLO without its threshold": (
        {"slo": {"objective": "99.9", "indicator": "latency"}},
        [
            "spec.slo: latencyThreshold is required when indicator is latency [layer 2 CEL rule"
            f" spec.slo#0, {CRD_FILE}] (found \"{{'objective': '99.9', 'indicator': 'latency',"
            " 'window': '28d'}\")"
        ],
    ),
    "a field the CRD does not have": (
        {"bogusField": 1},
        [
            "spec: Additional properties are not allowed ('bogusField' was unexpected)"
            f" [layer 1 schema, {CRD_FILE}] (found "
        ],
    ),
    "a member field the CRD does not have": (
        {"multiNode.members.0.bogus": 1},
        [
            "spec.multiNode.members.0: Additional properties are not allowed ('bogus' was"
            f" unexpected){OVERLAY} (found "
        ],
    ),
}


@pytest.mark.parametrize("case", sorted(RULES))
def test_a_service_that_breaks_one_rule_gets_exactly_that_rules_lines(case):
    edits, lines = RULES[case]
    found = validate_documents(tp3_with(edits), secrets=[])
    assert len(found) == len(lines), found
    for line, expected in zip(found, lines, strict=True):
        if expected.endswith("(found "):  # a schema line quoting a long object: up to the value
            assert line.startswith(f"{SERVICE}: {expected}"), line
        else:
            assert line == f"{SERVICE}: {expected}"


ALLOWED = {
    "replicas left out": {"replicas": DELETE},
    "a single node that leaves the sizes to the operator": {
        "multiNode": DELETE,
        "vllmConfig.tensorParallelSize": DELETE,
        "vllmConfig.pipelineParallelSize": DELETE,
    },
    "an SLO without an indicator (availability by default)": {"slo": {"objective": "99.9"}},
    "a nodeSelector (a map the CRD leaves open)": {
        "nodeSelector": {"kubernetes.io/hostname": "spark-1"}
    },
    "pipelineParallelSize left out (1)": {"vllmConfig.pipelineParallelSize": DELETE},
    "gpuMemoryUtilization left out": {"vllmConfig.gpuMemoryUtilization": DELETE},
    "two GPUs per member at TP3 x PP2": {"resources.gpu": 2, "vllmConfig.pipelineParallelSize": 2},
}


@pytest.mark.parametrize("case", sorted(ALLOWED))
def test_service_variants_the_rules_allow_pass_validation(case):
    assert validate_documents(tp3_with(ALLOWED[case]), secrets=[]) == []


def test_a_ring_whose_tp_divides_the_heads_needs_no_patch_job():
    docs = tp3_with({"vllmConfig.tensorParallelSize": 1, "vllmConfig.pipelineParallelSize": 3})
    without_patch = [d for d in docs if "tp3-patch" not in d.file]
    assert len(without_patch) == len(docs) - 4  # the ConfigMap and three Jobs
    assert validate_documents(without_patch, secrets=[]) == []


def test_a_patch_job_before_the_model_is_refused_by_the_apply_order_rule():
    docs = tp3_docs()
    job = next(d for d in docs if d.file == "40-job-dsv41-flash-tp3-patch-0.yaml")
    early = [docs[0], job] + [d for d in docs[1:] if d is not job]
    assert validate_documents(early, secrets=[]) == [
        "40-job-dsv41-flash-tp3-patch-0.yaml: metadata.name: the tp3-patch Job must come after"
        " the Model (the staged files) and before the InferenceService"
        " (found 'dsv41-flash-tp3-patch-0')"
    ]


@pytest.mark.parametrize(
    "secret", ["pässwörd-123", "tab\there", "a" * 1200 + " b" * 600], ids=["accents", "tab", "long"]
)
def test_a_secret_the_yaml_text_would_escape_or_fold_is_still_found(secret):
    docs = tp3_with({"env": [{"name": "LEAKED", "value": secret}]})
    found = validate_documents(docs, secrets=[secret])
    assert [line for line in found if "secret" in line] == [
        f"{SERVICE}: (document): contains a secret value from the environment (found '<redacted>')"
    ]


def test_an_unpinned_image_is_named_in_every_document_and_field_that_holds_it():
    profile = load_profile("tp3-ring")
    lock = load_lock(lock_path(profile.model.lock))
    image = "vllm/vllm-openai:v0.11.0"
    docs = render_kubernetes(profile, lock, image, PATCH_SOURCE.read_text())
    pinned = "image must be pinned by digest (found 'vllm/vllm-openai:v0.11.0')"
    jobs = [f"40-job-dsv41-flash-tp3-patch-{i}.yaml" for i in range(3)] + [
        f"50-job-dsv41-flash-node-prep-{i}.yaml" for i in range(3)
    ]
    assert validate_documents(docs, secrets=[]) == [
        *(f"{job}: spec.template.spec.containers.0.image: {pinned}" for job in jobs),
        f"{SERVICE}: spec.image: {pinned}",
    ]


def test_only_the_document_holding_a_secret_is_named_and_the_value_is_not():
    secret = "s3cr3t-value-123"
    docs = tp3_with({"env": [{"name": "LEAKED", "value": secret}]})
    found = validate_documents(docs, secrets=[secret, "never-rendered-value"])
    assert found[-1] == (
        f"{SERVICE}: (document): contains a secret value from the environment (found '<redacted>')"
    )
    assert [line for line in found if "secret value" in line] == found[-1:]
    assert secret not in "\n".join(found)


def test_violations_in_several_documents_are_all_reported_in_document_order():
    docs = []
    for doc in tp3_docs():
        body = copy.deepcopy(doc.body)
        if doc.file == "20-persistentvolumeclaim-dsv41-cache-spark-2.yaml":
            body["spec"]["accessModes"] = "ReadWriteOnce"
        if doc.body["kind"] == "InferenceService":
            body["spec"]["vllmConfig"]["pipelineParallelSize"] = 2
            body["spec"]["vllmConfig"]["gpuMemoryUtilization"] = 0.5
        docs.append(Document(doc.file, body))
    assert validate_documents(docs, secrets=[]) == [
        "20-persistentvolumeclaim-dsv41-cache-spark-2.yaml: spec.accessModes: 'ReadWriteOnce'"
        " is not of type 'array', 'null' (found 'ReadWriteOnce')",
        f"{SERVICE}: {PRODUCT_RULE} equal members x gpu = 3{GUARD} (found 6)",
        f"{SERVICE}: spec.vllmConfig.gpuMemoryUtilization: at TP3 must be at least 0.78"
        " (a smaller value leaves no KV pool) (found 0.5)",
    ]


def test_a_long_value_is_cut_to_80_characters_in_its_line():
    assert violation("a.yaml", ["spec", 0], "rule", "x" * 80) == (
        f"a.yaml: spec.0: rule (found '{'x' * 80}')"
    )
    assert violation("a.yaml", [], "rule", "y" * 81) == (
        f"a.yaml: (document): rule (found '{'y' * 77}...')"
    )
    assert violation("a.yaml", ["n"], "rule", {"k": 1}) == "a.yaml: n: rule (found \"{'k': 1}\")"
    assert violation("a.yaml", ["n"], "rule", None) == "a.yaml: n: rule (found None)"


def test_unknown_fields_are_refused_below_the_root_metadata_which_the_api_server_owns():
    svc = next(d for d in tp3_docs() if d.body["kind"] == "InferenceService")
    body = copy.deepcopy(svc.body)
    body["metadata"]["annotations"] = {"sparkforge/note": "any key"}
    claim = {"metadata": {"bogus": 1}, "spec": {"resources": {"requests": {"storage": "1Gi"}}}}
    body["spec"]["extraVolumes"].append(
        {"name": "scratch", "ephemeral": {"volumeClaimTemplate": claim}}
    )
    assert check_schema(Document(svc.file, body)) == [
        f"{svc.file}: spec.extraVolumes.2.ephemeral.volumeClaimTemplate.metadata: Additional"
        f" properties are not allowed ('bogus' was unexpected) [layer 1 schema, {CRD_FILE}]"
        " (found \"{'bogus': 1}\")"
    ]


def test_an_overlay_for_a_field_the_crd_lacks_names_the_missing_parent():
    crd = {"properties": {"spec": {"type": "object"}}}
    schema, added, _, _ = apply_overlay(crd, {"spec.newField": {"type": "string"}})
    assert schema["properties"]["spec"]["properties"] == {"newField": {"type": "string"}}
    assert added == ("spec.newField",) and crd == {"properties": {"spec": {"type": "object"}}}
    with pytest.raises(PipelineError) as err:
        apply_overlay(crd, {"spec.multiNode.members": {"type": "array"}})
    assert str(err.value) == (
        "overlay-pr1746.json: spec.multiNode.members: the derived schema has no 'multiNode'"
    )


# --- ring staging: what replaces the staging and patch Jobs ------------------------------------

STAGER = "ghcr.io/lab/sparkforge/weights-stager@sha256:" + "e" * 64


def staged_tp3_jobs(version: str, stager: str = STAGER) -> dict[str, dict]:
    """tp3-ring's Job bodies rendered with ring staging of a lock whose bytes are `version`."""
    docs = staged_tp3_render(version, IMAGE, stager)
    return {d.body["metadata"]["name"]: d.body for d in docs if d.body["kind"] == "Job"}


def test_a_new_lock_replaces_every_stage_job_and_an_equal_one_none():
    old, new, same = staged_tp3_jobs("v1"), staged_tp3_jobs("v2"), staged_tp3_jobs("v1")
    stage = [f"dsv41-flash-stage-weights-{r}" for r in range(3)]
    # A Job is replaced only when its body differs: a new lock must show in the body.
    assert all(old[name] != new[name] for name in stage)
    assert all(old[name] == same[name] for name in stage)


def test_a_patch_job_changes_exactly_when_its_members_stage_job_does():
    # Re-staging re-links the unpadded config.json: the patch must run again after it.
    v1, v2, stager2 = staged_tp3_jobs("v1"), staged_tp3_jobs("v2"), staged_tp3_jobs("v1", IMAGE)
    for other in (v2, stager2, staged_tp3_jobs("v1")):
        for r in range(3):
            stage, patch = f"dsv41-flash-stage-weights-{r}", f"dsv41-flash-tp3-patch-{r}"
            assert (v1[stage] != other[stage]) == (v1[patch] != other[patch])
    assert v1["dsv41-flash-stage-weights-0"] != stager2["dsv41-flash-stage-weights-0"]
