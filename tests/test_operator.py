"""Validation against the real operator: derived CRD schemas, their CEL rules, the admission
guard, our policy, the PR #1746 overlay, the deriver, and the volumes the tp3 service mounts."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from support import stages
from support.operator_repo import crd, git, operator_repo

from pipelines.core.errors import PipelineError
from pipelines.core.modellock import load_lock, lock_path
from pipelines.core.paths import LLMKUBE_SCHEMAS_DIR, PATCH_SOURCE, PROFILES_DIR
from pipelines.core.profiles import load_profile
from pipelines.engine.steps import Engine
from pipelines.engine.store import Store
from pipelines.stages.render import Render
from pipelines.stages.render.cache_mounts import check_cache_mounts
from pipelines.stages.render.crd_schema import (
    OVERLAY,
    apply_overlay,
    check_crd_schema,
    operator_schema,
    read_json,
)
from pipelines.stages.render.crds import DeriveError, derive, derive_kind
from pipelines.stages.render.documents import Document
from pipelines.stages.render.kubernetes import render_kubernetes
from pipelines.stages.render.operator_rules import cel_rules, check_admission, check_operator_rules
from pipelines.stages.render.validate import validate_layers

REPO = Path(__file__).resolve().parent.parent
KNOWN_GOOD = Path(__file__).parent / "data" / "operator" / "known-good.yaml"
IMAGE = "ghcr.io/lab/sparkforge/vllm-gb10-dsv41-exl3@sha256:" + "c" * 64
SERVICE = "60-inferenceservice-dsv41-flash.yaml"
ISVC_CRD = "LLMKube@907ac8d8 inference.llmkube.dev_inferenceservices.yaml"
MODEL_CRD = "LLMKube@907ac8d8 inference.llmkube.dev_models.yaml"


def known_good() -> list[tuple[Document, list[str]]]:
    """Our known-good documents, each with the policy lines it must get."""
    out = []
    for body in yaml.safe_load_all(KNOWN_GOOD.read_text()):
        policy = body.pop("policy", [])
        file = f"{body['kind'].lower()}-{body['metadata']['name']}.yaml"
        out.append((Document(file, body), [f"{file}: {line}" for line in policy]))
    return out


def tp3_docs(image: str = IMAGE) -> list[Document]:
    """The tp3-ring documents as rendered."""
    profile = load_profile("tp3-ring")
    lock = load_lock(lock_path(profile.model.lock))
    return render_kubernetes(profile, lock, image, PATCH_SOURCE.read_text())


def service(docs: list[Document]) -> Document:
    """The InferenceService among documents."""
    return next(d for d in docs if d.body["kind"] == "InferenceService")


def test_known_good_documents_pass_layers_1_2_and_policy_flags_exactly_the_listed_ones():
    cases = known_good()
    docs = [doc for doc, _ in cases]
    for doc in docs:
        assert check_crd_schema(doc) == [], doc.file
        assert check_operator_rules(doc) == [], doc.file
    layers = validate_layers(docs, secrets=[])
    assert layers["schema"] == [] and layers["operator"] == []
    assert sorted(layers["policy"]) == sorted(line for _, lines in cases for line in lines)
    # Between them the documents use every top-level spec field of both CRDs (and the overlay).
    for kind in ("Model", "InferenceService"):
        fields = set(operator_schema(kind).schema["properties"]["spec"]["properties"])
        used = {f for doc in docs if doc.body["kind"] == kind for f in doc.body["spec"]}
        assert used == fields, sorted(fields - used)
    covered = sum(
        len(operator_schema(k).schema["properties"]["spec"]["properties"])
        for k in ("Model", "InferenceService")
    )
    flagged = [doc.file for doc, lines in cases if lines]
    # 11 documents; 12 Model + 67 InferenceService spec fields of the CRDs + multiNode (overlay);
    # 3 policy findings in 3 documents (two images by tag, one cache without a volume).
    assert (len(docs), covered, len(layers["policy"]), len(flagged)) == (11, 80, 3, 3)


def minimal(kind: str, spec: dict) -> Document:
    """A small valid document of an llmkube kind with spec fields added."""
    base = {"Model": {"source": "Qwen/Qwen3-0.6B"}, "InferenceService": {"modelRef": "m"}}[kind]
    body = {
        "apiVersion": "inference.llmkube.dev/v1alpha1",
        "kind": kind,
        "metadata": {"name": "x"},
        "spec": {**base, **spec},
    }
    return Document(f"{kind.lower()}-x.yaml", body)


# A two-member group that keeps every rule (TP2 over two members of one GPU each).
GROUP = {
    "runtime": "vllm",
    "resources": {"gpu": 1},
    "vllmConfig": {"tensorParallelSize": 2},
    "multiNode": {"members": [{"node": "a", "fabric": {"address": "10.0.0.1"}}, {"node": "b"}]},
}
# Every CEL rule of the derived schemas: a document that breaks it (and only it).
BREAKS = {
    ("Model", "spec.hardware.gpu#0"): {
        "hardware": {
            "gpu": {
                "resourceName": "nvidia.com/gpu",
                "resourceClaims": [{"name": "a", "resourceClaimName": "c"}],
            }
        }
    },
    ("Model", "spec.hardware.gpu.resourceClaims#0"): {
        "hardware": {"gpu": {"resourceClaims": [{"name": "a"}]}}
    },
    ("InferenceService", "spec.modelCache#0"): {
        "modelCache": {"persistence": "Ephemeral", "claimName": "c"}
    },
    ("InferenceService", "spec.resources.gpuSharing#0"): {
        "resources": {"gpuSharing": {"mode": "partitioned"}}
    },
    # mode left out: the CRD's default (exclusive) applies before the rule, as on the server
    ("InferenceService", "spec.resources.gpuSharing#1"): {
        "resources": {"gpuSharing": {"profile": "1g.24gb"}}
    },
    ("InferenceService", "spec.resources.gpuSharing#2"): {
        "resources": {"gpuSharing": {"memoryLimitGiB": 4}}
    },
    ("InferenceService", "spec.slo#0"): {"slo": {"objective": "99", "indicator": "latency"}},
    ("InferenceService", "spec.slo.objective#0"): {"slo": {"objective": "99.9991"}},
    ("InferenceService", "spec.speculativeDecoding#0"): {"speculativeDecoding": {"type": "draft"}},
    ("InferenceService", "spec.speculativeDecoding#1"): {
        "speculativeDecoding": {"type": "mtp", "draftModel": "d.gguf"}
    },
    ("InferenceService", "spec.speculativeDecoding#2"): {
        "speculativeDecoding": {"type": "draft", "draftModel": "d.gguf", "draftModelRef": "d"}
    },
    # The merged multi-node rules (the PR #1746 overlay, until a refresh brings the CRD's own)
    ("InferenceService", "spec#0"): {**GROUP, "replicas": 2},
    ("InferenceService", "spec#1"): {**GROUP, "runtime": "sglang"},
    ("InferenceService", "spec.multiNode#0"): {
        **GROUP,
        "multiNode": {
            "members": [{"node": "a", "fabric": {"socketInterface": "e"}}, {"node": "b"}]
        },
    },
}


def test_every_cel_rule_of_the_derived_schemas_has_a_breaking_document():
    rules = {
        (k, r.name())
        for k in ("Model", "InferenceService")
        for r in cel_rules(operator_schema(k).schema)
    }
    assert rules == set(BREAKS)  # a refresh that adds a rule needs its breaking document here


@pytest.mark.parametrize("case", sorted(BREAKS), ids=lambda c: c[1])
def test_a_document_that_breaks_a_cel_rule_is_refused_naming_the_rule_and_its_source(case):
    kind, name = case
    doc = minimal(kind, BREAKS[case])
    assert check_crd_schema(doc) == []  # structurally fine: only the rule is broken
    [line] = check_operator_rules(doc)
    schema = operator_schema(kind)
    rule = next(r for r in cel_rules(schema.schema) if r.name() == name)
    source = MODEL_CRD if kind == "Model" else ISVC_CRD
    if rule.rule in schema.overlay_rules:
        source = "LLMKube PR #1746 overlay"
    where = name.split("#")[0].replace("[]", ".0")
    assert line.startswith(f"{doc.file}: {where}: {rule.message} [layer 2 CEL rule {name},")
    assert f"[layer 2 CEL rule {name}, {source}] (found " in line


def test_unknown_fields_are_refused_everywhere_but_root_metadata():
    doc = minimal("InferenceService", {"vllmConfig": {"tensorParalelSize": 2}, "bogus": 1})
    doc.body["metadata"].update(annotations={"a": "b"}, generateName="x-", uid="u")
    lines = check_crd_schema(doc)
    assert len(lines) == 2, lines
    assert lines[0].startswith(
        "inferenceservice-x.yaml: spec: Additional properties are not allowed ('bogus' was"
        f" unexpected) [layer 1 schema, {ISVC_CRD}]"
    )
    assert "'tensorParalelSize' was unexpected" in lines[1]
    assert lines[1].startswith("inferenceservice-x.yaml: spec.vllmConfig: ")


def test_int_or_string_fields_take_both_and_bounds_are_checked():
    volume = {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": 0}}
    for size in (0, "8Gi"):
        volume["emptyDir"]["sizeLimit"] = size
        assert check_crd_schema(minimal("InferenceService", {"extraVolumes": [volume]})) == []
    [line] = check_crd_schema(
        minimal("InferenceService", {"vllmConfig": {"gpuMemoryUtilization": 1.5}})
    )
    assert line == (
        "inferenceservice-x.yaml: spec.vllmConfig.gpuMemoryUtilization: 1.5 is greater than the"
        f" maximum of 0.99 [layer 1 schema, {ISVC_CRD}] (found 1.5)"
    )


def test_an_llmkube_kind_without_a_derived_schema_is_refused():
    doc = minimal("Model", {})
    doc.body["kind"] = "ModelRouter"
    assert check_crd_schema(doc) == [
        "model-x.yaml: kind: no derived schema for this llmkube kind [layer 1 schema,"
        " source.json] (found 'ModelRouter')"
    ]


def test_overlay_fields_are_checked_and_named_as_the_overlay_of_pr_1746():
    body = copy.deepcopy(service(tp3_docs()).body)
    body["spec"]["multiNode"]["members"][1]["fabric"]["ibHca"] = "x"
    body["spec"]["vllmConfig"]["pipelineParallelSize"] = 0
    first, second = check_crd_schema(Document(SERVICE, body))
    assert first.startswith(
        f"{SERVICE}: spec.multiNode.members.1.fabric: Additional properties are not allowed"
        " ('ibHca' was unexpected) [layer 1 schema, LLMKube PR #1746 overlay] (found "
    )
    assert second == (
        f"{SERVICE}: spec.vllmConfig.pipelineParallelSize: 0 is less than the minimum of 1"
        " [layer 1 schema, LLMKube PR #1746 overlay] (found 0)"
    )


def test_the_overlay_adds_only_what_the_derived_schema_lacks_and_is_a_noop_once_present():
    derived = read_json(LLMKUBE_SCHEMAS_DIR / "inferenceservice.json")["schema"]
    overlay = read_json(LLMKUBE_SCHEMAS_DIR / OVERLAY)
    additions = overlay["add"]["InferenceService"]
    constraints = overlay["constrain"]["InferenceService"]
    overlaid, added, constrained, rules = apply_overlay(derived, additions, constraints)
    assert added == ("spec.multiNode", "spec.vllmConfig.pipelineParallelSize", "status.multiNode")
    assert constrained == ("spec.resources.hostMemory", "spec.resources.memory")
    assert len(rules) == 3  # the group's rank-0 rule, and replicas and runtime on spec
    # A CRD that already has the fields and rules (as one derived after PR #1746 will):
    # nothing changes, even where the CRD's version of a field differs from the overlay's.
    newer = copy.deepcopy(overlaid)
    newer["properties"]["spec"]["properties"]["multiNode"]["properties"]["extra"] = {
        "type": "string"
    }
    newer["properties"]["spec"]["properties"]["resources"]["properties"]["memory"]["pattern"] = "x"
    again, *changed = apply_overlay(newer, additions, constraints)
    assert changed == [(), (), frozenset()] and again == newer
    assert operator_schema("Model").added == ()


def test_admission_guard_single_pod_and_group():
    one = {"resources": {"gpu": 2}, "vllmConfig": {"tensorParallelSize": 2}}
    assert check_admission(minimal("InferenceService", one)) == []
    over = {
        "resources": {"gpu": 2},
        "vllmConfig": {"tensorParallelSize": 2, "pipelineParallelSize": 2},
    }
    assert check_admission(minimal("InferenceService", over)) == [
        "inferenceservice-x.yaml: spec.vllmConfig.tensorParallelSize: tensorParallelSize x"
        " pipelineParallelSize must not exceed gpu = 2 [layer 2 reconcile-time rule, LLMKube PR"
        " #1746] (found 4)"
    ]
    # No GPU count: the operator skips the check (it derives the sizes, or cannot know them).
    unknown = {"vllmConfig": {"tensorParallelSize": 4}}
    assert check_admission(minimal("InferenceService", unknown)) == []
    body = copy.deepcopy(service(tp3_docs()).body)
    body["spec"]["resources"]["gpu"] = 2
    assert check_admission(Document(SERVICE, body)) == [
        f"{SERVICE}: spec.vllmConfig.tensorParallelSize: tensorParallelSize x pipelineParallelSize"
        " must equal members x gpu = 6 [layer 2 reconcile-time rule, LLMKube PR #1746] (found 3)"
    ]
    body["spec"]["resources"]["gpu"] = 1
    members = body["spec"]["multiNode"]["members"]
    members[2]["node"] = members[0]["node"]
    assert check_admission(Document(SERVICE, body)) == [
        f"{SERVICE}: spec.multiNode.members.2.node: members[0] is on this node too: one member"
        f" per node [layer 2 reconcile-time rule, LLMKube PR #1746] (found '{members[0]['node']}')"
    ]


def test_tp3_ring_mounts_shm_in_memory_and_one_cache_volume_and_passes_every_layer():
    docs = tp3_docs()
    assert validate_layers(docs, secrets=[]) == {"schema": [], "operator": [], "policy": []}
    spec = service(docs).body["spec"]
    assert spec["extraVolumes"] == [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}},
        {
            "name": "jit-cache",
            "hostPath": {"path": "/var/lib/sparkforge/jit-cache", "type": "DirectoryOrCreate"},
        },
    ]
    assert spec["extraVolumeMounts"] == [
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "jit-cache", "mountPath": "/cache"},
    ]


CACHE_VARS = [
    "CUDA_CACHE_PATH",
    "HF_HOME",
    "TORCHINDUCTOR_CACHE_DIR",
    "TRITON_CACHE_DIR",
    "VLLM_CACHE_ROOT",
]


@pytest.mark.parametrize(
    "edit",
    ["no mounts", "read-only mount", "mount of a volume that does not exist", "mount elsewhere"],
)
def test_cache_variables_without_a_writable_mount_are_refused_as_policy(edit):
    body = copy.deepcopy(service(tp3_docs()).body)
    spec = body["spec"]
    cache = spec["extraVolumeMounts"][1]
    if edit == "no mounts":
        del spec["extraVolumeMounts"]
    elif edit == "read-only mount":
        cache["readOnly"] = True
    elif edit == "mount of a volume that does not exist":
        cache["name"] = "jit"
    else:
        cache["mountPath"] = "/cache/vllm"
    lines = check_cache_mounts([Document(SERVICE, body)])
    expected = (
        CACHE_VARS
        if edit != "mount elsewhere"
        else [v for v in CACHE_VARS if v != "VLLM_CACHE_ROOT"]
    )
    assert [line.split(": ")[1] for line in lines] == [f"spec.env.{v}" for v in expected]
    assert all("no writable extraVolumeMounts entry provides" in line for line in lines)
    assert all("[layer 3 policy]" in line for line in lines)


def render_stage(profile, store_root: Path, image: str = IMAGE) -> Render:
    """The render stage of a profile as dodo wires it."""
    return stages.render_stage(profile, Engine(Store(store_root), root=REPO), image)


# Profiles the loader accepts that our policy refuses (test_render.py has four more; the loader
# itself refuses a parallelism the ring cannot hold): (edit of tp3-ring.yaml, the image, a line
# that must appear).
CACHE = "cache variable points at a path no writable extraVolumeMounts entry provides"
BROKEN = {
    "a cache beside the mount, not under it": (
        ("env:\n", "env:\n  TRANSFORMERS_CACHE: /cache2/transformers\n"),
        IMAGE,
        f"{SERVICE}: spec.env.TRANSFORMERS_CACHE: {CACHE} (a restart loses it) [layer 3 policy]"
        " (found '/cache2/transformers')",
    ),
    "torch hub off the volume": (
        ("env:\n", "env:\n  TORCH_HOME: /root/.cache/torch\n"),
        IMAGE,
        f"{SERVICE}: spec.env.TORCH_HOME: {CACHE} (a restart loses it) [layer 3 policy]"
        " (found '/root/.cache/torch')",
    ),
    "XDG cache off the volume": (
        ("env:\n", "env:\n  XDG_CACHE_HOME: /root/.cache\n"),
        IMAGE,
        f"{SERVICE}: spec.env.XDG_CACHE_HOME: {CACHE} (a restart loses it) [layer 3 policy]"
        " (found '/root/.cache')",
    ),
    "torch extensions off the volume": (
        ("env:\n", "env:\n  TORCH_EXTENSIONS_DIR: /tmp/torch_extensions\n"),
        IMAGE,
        f"{SERVICE}: spec.env.TORCH_EXTENSIONS_DIR: {CACHE} (a restart loses it)"
        " [layer 3 policy] (found '/tmp/torch_extensions')",
    ),
    "a relative hub cache": (
        ("env:\n", "env:\n  HF_HUB_CACHE: hub\n"),
        IMAGE,
        f"{SERVICE}: spec.env.HF_HUB_CACHE: {CACHE} (a restart loses it) [layer 3 policy]"
        " (found 'hub')",
    ),
    "FlashInfer workspace off the volume": (
        ("env:\n", "env:\n  FLASHINFER_WORKSPACE_BASE: /workspace\n"),
        IMAGE,
        f"{SERVICE}: spec.env.FLASHINFER_WORKSPACE_BASE: {CACHE} (a restart loses it)"
        " [layer 3 policy] (found '/workspace')",
    ),
    "an image by tag": (
        ("", ""),
        "vllm/vllm-openai:latest",
        f"{SERVICE}: spec.image: image must be pinned by digest (found 'vllm/vllm-openai:latest')",
    ),
    "a truncated digest": (
        ("", ""),
        "vllm/vllm-openai@sha256:d84a1232",
        f"{SERVICE}: spec.image: image must be pinned by digest"
        " (found 'vllm/vllm-openai@sha256:d84a1232')",
    ),
    "a digest in capitals": (
        ("", ""),
        "v/o@sha256:" + "D" * 64,
        f"{SERVICE}: spec.image: image must be pinned by digest (found 'v/o@sha256:{'D' * 64}')",
    ),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_profile_is_refused_by_its_layer_and_writes_nothing(case, tmp_path):
    (old, new), image, expected = BROKEN[case]
    text = (PROFILES_DIR / "tp3-ring.yaml").read_text()
    assert old in text
    folder = tmp_path / "profiles"
    folder.mkdir()
    (folder / "tp3-ring.yaml").write_text(text.replace(old, new, 1))
    stage = render_stage(load_profile("tp3-ring", folder), tmp_path / "store", image)
    with pytest.raises(PipelineError) as err:
        stage.engine.run(stage.step)
    lines = str(err.value).splitlines()
    assert expected in lines, lines
    assert all(line.count(": ") >= 2 for line in lines), lines
    assert not list((stage.engine.store.root / "steps").iterdir())
    assert not list((stage.engine.store.root / "tmp").iterdir())


def test_doit_render_output_mounts_shm_and_the_cache(tmp_path):
    env = {**os.environ, "SPARKFORGE_STORE": str(tmp_path / "store")}
    args = [
        sys.executable,
        "-m",
        "doit",
        "render",
        "profile=tp3-ring",
        "image_digest=sha256:" + "e" * 64,
    ]
    result = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr + result.stdout
    [path] = (tmp_path / "store").glob(f"steps/*/out/{SERVICE}")
    spec = yaml.safe_load(path.read_text())["spec"]
    mounts = {m["mountPath"]: m["name"] for m in spec["extraVolumeMounts"]}
    volumes = {v["name"]: v for v in spec["extraVolumes"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}
    assert "hostPath" in volumes[mounts["/cache"]]


def test_doit_list_imports_neither_the_cel_library_nor_jsonschema():
    code = (
        "import runpy, sys; sys.argv = ['doit', 'list']; runpy.run_module('doit', run_name="
        "'__main__')"
    )
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", code], cwd=REPO, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-2000:]
    modules = {
        line.rsplit("|", 1)[-1].strip()
        for line in result.stderr.splitlines()
        if line.startswith("import time:")
    }
    assert "build" in result.stdout
    assert not {"cel", "jsonschema", "kubernetes_validate"} & modules


def test_the_deriver_keeps_the_facts_drops_the_prose_and_records_its_source(tmp_path):
    repo = operator_repo(tmp_path)
    out = tmp_path / "schemas"
    commit = git(repo, "rev-parse", "HEAD").strip()
    record = derive(repo, "HEAD", out)
    model = json.loads((out / "model.json").read_text())
    assert model["apiVersion"] == "inference.llmkube.dev/v1alpha1" and model["kind"] == "Model"
    spec = model["schema"]["properties"]["spec"]
    assert "description" not in json.dumps(model)
    assert spec["required"] == ["source"] and spec["properties"]["source"]["pattern"] == "^s3://"
    assert spec["properties"]["size"]["x-kubernetes-int-or-string"] is True
    assert spec["properties"]["opaque"]["x-kubernetes-preserve-unknown-fields"] is True
    gpu = spec["properties"]["gpu"]
    assert gpu["x-kubernetes-validations"] == [{"rule": "self.count <= 8", "message": "at most 8"}]
    assert gpu["properties"]["count"] == {"type": "integer", "minimum": 0, "maximum": 8}
    assert record["commit"] == commit and record["date"] == "2026-08-22T11:17:43-07:00"
    saved = json.loads((out / "source.json").read_text())
    assert saved == record and saved["repository"] == "https://github.com/defilantech/LLMKube"
    for f in saved["files"]:
        text = (repo / f["path"]).read_bytes()
        assert f["sha256"] == hashlib.sha256(text).hexdigest()


def test_the_deriver_refuses_a_keyword_it_does_not_know_rather_than_dropping_it(tmp_path):
    repo = operator_repo(tmp_path, extra={"x-kubernetes-new-check": True})
    with pytest.raises(DeriveError) as err:
        derive(repo, "HEAD", tmp_path / "schemas")
    assert (
        str(err.value) == ".spec.gpu: keyword 'x-kubernetes-new-check' is not one the deriver knows"
    )
    assert not (tmp_path / "schemas").exists()


# One construct of the CRDs' OpenAPI schemas each: what it is in a CRD and what the deriver keeps.
CONSTRUCTS = {
    "nested properties": (
        {"type": "object", "properties": {"a": {"type": "object", "description": "x",
         "properties": {"b": {"type": "string", "description": "y"}}}}},
        {"type": "object", "properties": {"a": {"type": "object",
         "properties": {"b": {"type": "string"}}}}},
    ),
    "x-kubernetes-validations": (
        {"type": "object", "x-kubernetes-validations": [
            {"rule": "self.a > 0", "message": "a positive", "fieldPath": ".a", "reason":
             "FieldValueInvalid", "messageExpression": "'a=' + string(self.a)"}]},
        {"type": "object", "x-kubernetes-validations": [
            {"rule": "self.a > 0", "message": "a positive", "fieldPath": ".a", "reason":
             "FieldValueInvalid", "messageExpression": "'a=' + string(self.a)"}]},
    ),
    "x-kubernetes-preserve-unknown-fields": (
        {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
        {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
    ),
    "x-kubernetes-int-or-string": (
        {"anyOf": [{"type": "integer"}, {"type": "string"}], "x-kubernetes-int-or-string": True,
         "pattern": "^[0-9]+Gi$"},
        {"anyOf": [{"type": "integer"}, {"type": "string"}], "x-kubernetes-int-or-string": True,
         "pattern": "^[0-9]+Gi$"},
    ),
    "list types": (
        {"type": "array", "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"],
         "maxItems": 4, "items": {"type": "object", "required": ["name"], "description": "x",
                                  "properties": {"name": {"type": "string"}}}},
        {"type": "array", "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"],
         "maxItems": 4, "items": {"type": "object", "required": ["name"],
                                  "properties": {"name": {"type": "string"}}}},
    ),
    "enums": (
        {"type": "string", "enum": ["IfNotPresent", "OnChange"], "description": "x"},
        {"type": "string", "enum": ["IfNotPresent", "OnChange"]},
    ),
    "defaults": (
        {"type": "integer", "default": 29500, "minimum": 1, "maximum": 65535},
        {"type": "integer", "default": 29500, "minimum": 1, "maximum": 65535},
    ),
    "format int32/int64": (
        {"type": "object", "properties": {"a": {"type": "integer", "format": "int32"},
                                          "b": {"type": "integer", "format": "int64"}}},
        {"type": "object", "properties": {"a": {"type": "integer", "format": "int32"},
                                          "b": {"type": "integer", "format": "int64"}}},
    ),
    "map values (additionalProperties)": (
        {"type": "object", "additionalProperties": {"type": "string", "description": "x"}},
        {"type": "object", "additionalProperties": {"type": "string"}},
    ),
}  # fmt: skip


@pytest.mark.parametrize("construct", sorted(CONSTRUCTS))
def test_the_deriver_keeps_each_construct_of_a_crd_schema(construct):
    field, kept = CONSTRUCTS[construct]
    text = yaml.safe_dump(crd("Model", "models", {"type": "object", "properties": {"f": field}}))
    derived = derive_kind(text.encode(), "Model", "models.yaml")
    assert derived["schema"]["properties"]["spec"]["properties"]["f"] == kept


def sample(name: str, spec: dict) -> dict:
    """A Model document as the operator's samples write one."""
    return {
        "apiVersion": "inference.llmkube.dev/v1alpha1",
        "kind": "Model",
        "metadata": {"name": name},
        "spec": spec,
    }


def checkable_operator(tmp_path: Path) -> tuple[Path, Path]:
    """An operator repository with samples, and schemas derived from it: (repo, schemas)."""
    repo = operator_repo(tmp_path)
    # An InferenceService with the fields the PR #1746 overlay adds to (so it applies).
    vllm = {"type": "object", "properties": {"tensorParallelSize": {"type": "integer"}}}
    spec = {"type": "object", "properties": {"modelRef": {"type": "string"}, "vllmConfig": vllm}}
    isvc = crd("InferenceService", "inferenceservices", spec)
    root = isvc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    root["properties"]["status"] = {"type": "object"}
    (repo / "config/crd/bases/inference.llmkube.dev_inferenceservices.yaml").write_text(
        yaml.safe_dump(isvc)
    )
    (repo / "config/samples").mkdir()
    (repo / "examples/quickstart").mkdir(parents=True)
    # A Model and a non-llmkube document in one file; a second Model under examples/.
    (repo / "config/samples/model.yaml").write_text(
        yaml.safe_dump_all(
            [sample("a", {"source": "s3://m/a"}), {"apiVersion": "v1", "kind": "Secret"}]
        )
    )
    (repo / "examples/quickstart/model.yaml").write_text(
        yaml.safe_dump(sample("b", {"source": "s3://m/b", "size": "8Gi", "gpu": {"count": 2}}))
    )
    (repo / "examples/README.md").write_text("not a sample\n")
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "samples")
    schemas = tmp_path / "schemas"
    derive(repo, "HEAD", schemas)
    shutil.copy(LLMKUBE_SCHEMAS_DIR / OVERLAY, schemas / OVERLAY)
    return repo, schemas


def crds_check(repo: Path, schemas: Path) -> subprocess.CompletedProcess:
    """`python -m pipelines.stages.render.crds check` as a person runs it by hand."""
    return subprocess.run(
        [sys.executable, "-m", "pipelines.stages.render.crds", "check", "--operator", str(repo),
         "--schemas", str(schemas)],
        cwd=REPO, capture_output=True, text=True,
    )  # fmt: skip


def test_the_operator_check_passes_schemas_derived_at_the_recorded_commit(tmp_path):
    repo, schemas = checkable_operator(tmp_path)
    result = crds_check(repo, schemas)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "model.json: byte-identical to what config/crd/bases/inference.llmkube.dev_models.yaml"
        " derives to",
        "inferenceservice.json: byte-identical to what"
        " config/crd/bases/inference.llmkube.dev_inferenceservices.yaml derives to",
        "2 of 2 samples (Model, InferenceService) under config/samples, examples pass layers 1"
        " and 2",
    ]


def test_the_operator_check_lists_what_moved_at_head_and_fails(tmp_path):
    repo, schemas = checkable_operator(tmp_path)
    crd_file = repo / "config/crd/bases/inference.llmkube.dev_models.yaml"
    body = yaml.safe_load(crd_file.read_text())
    spec = body["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    spec["properties"]["source"]["pattern"] = "^gs://"  # a bound moved
    spec["properties"]["maxLifetimeSeconds"] = {"type": "integer", "minimum": 60}  # a field
    spec["required"].append("maxLifetimeSeconds")
    spec["properties"]["gpu"]["x-kubernetes-validations"].append(  # a rule
        {"rule": "self.count % 2 == 0", "message": "even"}
    )
    del spec["properties"]["opaque"]
    crd_file.write_text(yaml.safe_dump(body))
    git(repo, "commit", "-q", "-am", "later")
    head = git(repo, "rev-parse", "HEAD").strip()
    result = crds_check(repo, schemas)
    assert result.returncode == 1
    assert result.stdout.splitlines()[3:] == [
        f"Model at HEAD {head[:12]} against model.json:",
        "  ~ .spec.maxLifetimeSeconds: now required",
        "  + .spec.gpu rule: self.count % 2 == 0",
        "  + .spec.maxLifetimeSeconds (integer)",
        "  - .spec.opaque",
        '  ~ .spec.source pattern: "^s3://" -> "^gs://"',
        "2 of 2 samples (Model, InferenceService) under config/samples, examples at HEAD"
        f" {head[:12]} pass layers 1 and 2",
    ]
    recorded = json.loads((schemas / "source.json").read_text())["commit"]
    assert result.stderr == (
        "error: config/crd/bases/inference.llmkube.dev_models.yaml: 5 change(s) since"
        f" {recorded[:12]}, the commit {schemas / 'source.json'} records: derive again, review"
        " the diff, commit\n"
    )
    git(repo, "checkout", "-q", recorded)  # the checkout at the recorded commit: all agrees
    assert crds_check(repo, schemas).returncode == 0


def test_the_operator_check_at_a_later_head_with_the_crds_unchanged_passes(tmp_path):
    repo, schemas = checkable_operator(tmp_path)
    (repo / "README.md").write_text("a later commit that leaves the CRDs alone\n")
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "docs")
    result = crds_check(repo, schemas)
    assert result.returncode == 0, result.stderr
    assert "no CRD changed since" in result.stdout


def test_the_operator_check_fails_on_a_sample_added_at_head_that_the_schemas_refuse(tmp_path):
    repo, schemas = checkable_operator(tmp_path)
    (repo / "config/samples/later.yaml").write_text(
        yaml.safe_dump(sample("d", {"source": "gs://m/d"}))
    )
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "a sample")
    result = crds_check(repo, schemas)
    assert result.returncode == 1
    assert "error: config/samples/later.yaml#0: spec.source: " in result.stderr


def test_the_operator_check_fails_on_a_schema_that_differs_or_a_crd_of_another_hash(tmp_path):
    repo, schemas = checkable_operator(tmp_path)
    model = schemas / "model.json"
    model.write_text(model.read_text().replace("^s3://", "^gs://"))
    result = crds_check(repo, schemas)
    assert result.returncode == 1
    assert f"error: {model}: differs from what config/crd/bases/" in result.stderr
    record = json.loads((schemas / "source.json").read_text())
    record["files"][1]["sha256"] = "0" * 64
    (schemas / "source.json").write_text(json.dumps(record))
    result = crds_check(repo, schemas)
    assert result.returncode == 1
    assert "inference.llmkube.dev_inferenceservices.yaml: sha256 " in result.stderr
    assert f"source.json records {'0' * 64}" in result.stderr


def test_the_operator_check_fails_on_a_sample_the_schemas_refuse(tmp_path):
    repo, schemas = checkable_operator(tmp_path)
    (repo / "config/samples/bad.yaml").write_text(
        yaml.safe_dump(sample("c", {"source": "s3://m/c", "gpu": {"count": 9}}))
    )
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "bad sample")
    derive(repo, "HEAD", schemas)
    result = crds_check(repo, schemas)
    assert result.returncode == 1
    assert "2 of 3 samples" in result.stdout
    # Refused by the folder's own schema (the synthetic CRD's bound), not the project's.
    assert "error: config/samples/bad.yaml#0: spec.gpu.count: 9 is greater than the maximum" in (
        result.stderr
    )


def test_the_operator_check_refuses_a_source_record_of_the_wrong_shape_in_one_line(tmp_path):
    repo, schemas = checkable_operator(tmp_path)
    record = json.loads((schemas / "source.json").read_text())
    record["files"][0]["sha256"] = 7
    (schemas / "source.json").write_text(json.dumps(record))
    result = crds_check(repo, schemas)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"error: {schemas / 'source.json'}: Expected `str`, got `int` - at `$.files[0].sha256`"
    ]


def test_the_operator_check_refuses_a_folder_that_is_not_the_operators_repository(tmp_path):
    _, schemas = checkable_operator(tmp_path)
    (tmp_path / "empty").mkdir()
    result = crds_check(tmp_path / "empty", schemas)
    assert result.returncode == 2
    [line] = result.stderr.splitlines()
    assert line.startswith(f"error: {tmp_path / 'empty'}: ")


# The probes of the merged operator (its Go markers): each edit of tp3-ring's service, and what
# the operator says of it at admission (None: accepted).
MERGED_PROBES = {
    "rendezvousPort 1023": (
        ("multiNode", "rendezvousPort"),
        1023,
        "spec.multiNode.rendezvousPort: 1023 is less than the minimum of 1024",
    ),
    "a member's modelCache with no claim": (
        ("multiNode", "members", 1, "modelCache"),
        {},
        "spec.multiNode.members.1.modelCache: 'claimName' is a required property",
    ),
    "memory 110 GiB": (
        ("resources", "memory"),
        "110 GiB",
        "spec.resources.memory: '110 GiB' does not match",
    ),
    "a 254-character claim name": (
        ("multiNode", "members", 1, "modelCache", "claimName"),
        "c" * 254,
        None,
    ),
    "replicas 0": (("replicas",), 0, None),
}


@pytest.mark.parametrize("probe", sorted(MERGED_PROBES))
def test_the_schemas_say_what_the_merged_operator_says_of_each_probe(probe):
    path, value, said = MERGED_PROBES[probe]
    body = copy.deepcopy(service(tp3_docs()).body)
    node = body["spec"]
    for key in path[:-1]:
        node = node.setdefault(key, {}) if isinstance(key, str) else node[key]
    node[path[-1]] = value
    doc = Document(SERVICE, body)
    lines = check_crd_schema(doc) + check_operator_rules(doc)
    if said is None:
        assert lines == []
    else:
        [line] = lines
        assert line.startswith(f"{SERVICE}: {said}"), line
        assert "[layer 1 schema, LLMKube PR #1746 overlay]" in line
