"""Offline checks of rendered documents, in four layers; each violation is one line: document,
path, rule, value.

1. llmkube kinds against the schemas derived from the operator's CRDs (crd_schema.py);
2. the operator's own rules: its CEL rules and what it checks when it reconciles
   (operator_rules.py);
3. policy, ours: the ring's rules below, caches on volumes (cache_mounts.py), no secrets;
4. core kinds against Kubernetes' own schemas (kubernetes-validate).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from pipelines.stages.render.cache_mounts import check_cache_mounts
from pipelines.stages.render.core_schema import check_core_schema
from pipelines.stages.render.crd_schema import check_crd_schema
from pipelines.stages.render.documents import LLMKUBE, Document
from pipelines.stages.render.operator_rules import check_operator_rules
from pipelines.stages.render.violations import violation

__all__ = ["check_operator_rules", "violation"]  # re-exported: callers check one layer alone

ROCE_DEVICES = ("rocep1s0f0", "rocep1s0f1", "roceP2p1s0f0", "roceP2p1s0f1")
ATTENTION_HEADS = 64  # DeepSeek-V4.1-Flash; a TP that does not divide it needs the padded config
TP3_MIN_GPU_MEMORY = 0.78  # measured floor that leaves a KV pool at TP3 (0.72 goes negative)
PINNED = re.compile(r"@sha256:[0-9a-f]{64}$")


def check_schema(doc: Document) -> list[str]:
    """Layer 1 for llmkube kinds, layer 4 for core kinds; unknown fields are errors in both."""
    if doc.body.get("apiVersion") == LLMKUBE:
        return check_crd_schema(doc)
    return check_core_schema(doc)


def env_of(spec: dict[str, Any]) -> dict[str, str]:
    """The env list of a spec as a dict."""
    return {e.get("name"): e.get("value") for e in spec.get("env", [])}


def check_ring_rules(docs: list[Document]) -> list[str]:
    """This ring's own rules: padded config for TP3, routing, RoCE devices, pinned images."""
    found = []
    services = [d for d in docs if d.body.get("kind") == "InferenceService"]
    for svc in services:
        spec = svc.body["spec"]
        members = spec.get("multiNode", {}).get("members", [])
        tp = spec.get("vllmConfig", {}).get("tensorParallelSize", 1)
        if ATTENTION_HEADS % tp:
            found += check_patch_jobs(docs, svc, members, tp)
        if (
            tp == 3
            and spec.get("vllmConfig", {}).get("gpuMemoryUtilization", 1) < TP3_MIN_GPU_MEMORY
        ):
            found.append(
                violation(
                    svc.file,
                    ["spec", "vllmConfig", "gpuMemoryUtilization"],
                    f"at TP3 must be at least {TP3_MIN_GPU_MEMORY} (a smaller value"
                    " leaves no KV pool)",
                    spec["vllmConfig"]["gpuMemoryUtilization"],
                )
            )
        if len(members) % 2 == 1 and env_of(spec).get("NCCL_IB_SUBNET_AWARE_ROUTING") != "1":
            found.append(
                violation(
                    svc.file,
                    ["spec", "env", "NCCL_IB_SUBNET_AWARE_ROUTING"],
                    f"an odd ring ({len(members)} members) needs 1 or NCCL cannot close the cycle",
                    env_of(spec).get("NCCL_IB_SUBNET_AWARE_ROUTING"),
                )
            )
        for i, member in enumerate(members):
            hca = member.get("fabric", {}).get("ibHCA", "")
            if sorted(hca.split(",")) != sorted(ROCE_DEVICES):
                found.append(
                    violation(
                        svc.file,
                        ["spec", "multiNode", "members", i, "fabric", "ibHCA"],
                        f"must list all four RoCE devices {','.join(ROCE_DEVICES)}",
                        hca,
                    )
                )
    for doc in docs:
        for path, image in images_in(doc.body):
            if not PINNED.search(str(image)):
                found.append(violation(doc.file, path, "image must be pinned by digest", image))
    return found


def check_patch_jobs(
    docs: list[Document], svc: Document, members: list[dict[str, Any]], tp: int
) -> list[str]:
    """Every member of a TP that does not divide the heads gets the patch Job, applied first."""
    found = []
    models = [d for d in docs if d.body.get("kind") == "Model"]
    jobs = {
        d.body["spec"]["template"]["spec"].get("nodeName"): d
        for d in docs
        if d.body.get("kind") == "Job" and "tp3-patch" in d.body["metadata"]["name"]
    }
    for i, member in enumerate(members):
        job = jobs.get(member.get("node"))
        if job is None:
            found.append(
                violation(
                    svc.file,
                    ["spec", "multiNode", "members", i, "node"],
                    f"TP{tp} needs the padded config: no tp3-patch Job for this member",
                    member.get("node"),
                )
            )
        elif not models or not docs.index(models[0]) < docs.index(job) < docs.index(svc):
            found.append(
                violation(
                    job.file,
                    ["metadata", "name"],
                    "the tp3-patch Job must come after the Model (the staged files) and before"
                    " the InferenceService",
                    job.body["metadata"]["name"],
                )
            )
    return found


def images_in(
    body: Any, path: tuple[str | int, ...] = ()
) -> Iterable[tuple[tuple[str | int, ...], Any]]:
    """(path, value) of every `image` field in a document."""
    if isinstance(body, dict):
        for key, value in body.items():
            if key == "image" and isinstance(value, str):
                yield (*path, key), value
            else:
                yield from images_in(value, (*path, key))
    elif isinstance(body, list):
        for i, value in enumerate(body):
            yield from images_in(value, (*path, i))


def scalars_in(body: Any) -> Iterable[str]:
    """Every key and scalar value of a document as text, nested ones included."""
    if isinstance(body, dict):
        for key, value in body.items():
            yield str(key)
            yield from scalars_in(value)
    elif isinstance(body, list):
        for value in body:
            yield from scalars_in(value)
    elif body is not None:
        yield str(body)


def check_secrets(docs: list[Document], secrets: list[str]) -> list[str]:
    """No secret value anywhere in any document (Secrets are referenced by name only). The
    values are searched, not the YAML text, where escapes and folded lines would hide one."""
    found = []
    for doc in docs:
        if any(secret in text for text in scalars_in(doc.body) for secret in secrets if secret):
            found.append(
                violation(
                    doc.file, [], "contains a secret value from the environment", "<redacted>"
                )
            )
    return found


def validate_layers(docs: list[Document], secrets: list[str]) -> dict[str, list[str]]:
    """Every violation, by layer: schemas (1 and 4), the operator's rules (2), policy (3)."""
    return {
        "schema": [line for doc in docs for line in check_schema(doc)],
        "operator": [
            line
            for doc in docs
            if doc.body.get("apiVersion") == LLMKUBE
            for line in check_operator_rules(doc)
        ],
        "policy": check_ring_rules(docs) + check_cache_mounts(docs) + check_secrets(docs, secrets),
    }


def validate_documents(docs: list[Document], secrets: list[str]) -> list[str]:
    """Every violation in the rendered documents, layer by layer (empty when they may apply)."""
    return [line for lines in validate_layers(docs, secrets).values() for line in lines]
