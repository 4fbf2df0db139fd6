"""Offline checks of rendered documents; each violation is one line: document, path, rule, value."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from functools import cache
from typing import Any

from pipelines.paths import SCHEMAS_DIR
from pipelines.render.documents import LLMKUBE, Document

K8S_VERSION = "1.33"
ROCE_DEVICES = ("rocep1s0f0", "rocep1s0f1", "roceP2p1s0f0", "roceP2p1s0f1")
ATTENTION_HEADS = 64  # DeepSeek-V4.1-Flash; a TP that does not divide it needs the padded config
TP3_MIN_GPU_MEMORY = 0.78  # measured floor that leaves a KV pool at TP3 (0.72 goes negative)
PINNED = re.compile(r"@sha256:[0-9a-f]{64}$")


def violation(doc: str, path: Iterable, rule: str, found: Any) -> str:
    """One line naming the document, the field path, the rule and the value found."""
    dotted = ".".join(str(p) for p in path) or "(document)"
    shown = found if isinstance(found, (int, float, bool)) or found is None else str(found)
    if isinstance(shown, str) and len(shown) > 80:
        shown = shown[:77] + "..."
    return f"{doc}: {dotted}: {rule} (found {shown!r})"


@cache
def llmkube_schema(kind: str) -> dict:
    """The JSON Schema this project keeps for an llmkube kind."""
    return json.loads((SCHEMAS_DIR / f"{kind.lower()}.schema.json").read_text())


def check_schema(doc: Document) -> list[str]:
    """llmkube kinds against our schemas; core kinds against Kubernetes' own, unknown fields out."""
    import jsonschema  # loaded when something is rendered, not for a no-op run
    import kubernetes_validate

    body = doc.body
    if body.get("apiVersion") == LLMKUBE:
        validator = jsonschema.Draft202012Validator(
            llmkube_schema(body["kind"]), format_checker=jsonschema.FormatChecker()
        )
        errors = sorted(validator.iter_errors(body), key=lambda e: list(e.absolute_path))
        return [violation(doc.file, e.absolute_path, e.message, e.instance) for e in errors]
    try:
        kubernetes_validate.validate(body, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as err:
        return [violation(doc.file, err.absolute_path, err.message, err.instance)]
    return []


def check_operator_rules(doc: Document) -> list[str]:
    """The operator's cross-field rules for a multi-node InferenceService (its CEL rules)."""
    spec = doc.body.get("spec", {})
    multi = spec.get("multiNode")
    if not multi:
        return []
    found = []
    members = multi.get("members", [])
    if not members or not members[0].get("fabric", {}).get("address"):
        found.append(
            violation(
                doc.file,
                ["spec", "multiNode", "members", 0, "fabric", "address"],
                "required: the rendezvous address of rank 0",
                None,
            )
        )
    if spec.get("replicas") not in (None, 1):
        found.append(
            violation(
                doc.file,
                ["spec", "replicas"],
                "must be 1 or unset with multiNode",
                spec.get("replicas"),
            )
        )
    if spec.get("runtime") != "vllm":
        found.append(
            violation(
                doc.file, ["spec", "runtime"], "multiNode needs runtime vllm", spec.get("runtime")
            )
        )
    vllm = spec.get("vllmConfig", {})
    product = vllm.get("tensorParallelSize", 1) * vllm.get("pipelineParallelSize", 1)
    gpus = len(members) * spec.get("resources", {}).get("gpu", 0)
    if product != gpus:
        found.append(
            violation(
                doc.file,
                ["spec", "vllmConfig", "tensorParallelSize"],
                f"tensorParallelSize x pipelineParallelSize must equal members x gpu = {gpus}",
                product,
            )
        )
    return found


def env_of(spec: dict) -> dict[str, str]:
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


def check_patch_jobs(docs: list[Document], svc: Document, members: list, tp: int) -> list[str]:
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


def images_in(body: Any, path: tuple = ()) -> Iterable[tuple[tuple, Any]]:
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


def check_secrets(docs: list[Document], secrets: list[str]) -> list[str]:
    """No secret value anywhere in any document (Secrets are referenced by name only)."""
    found = []
    for doc in docs:
        text = doc.text()
        for secret in secrets:
            if secret in text:
                found.append(
                    violation(
                        doc.file, [], "contains a secret value from the environment", "<redacted>"
                    )
                )
    return found


def validate_documents(docs: list[Document], secrets: list[str]) -> list[str]:
    """Every violation in the rendered documents (empty when they may be applied)."""
    found = []
    for doc in docs:
        found += check_schema(doc)
        if doc.body.get("kind") == "InferenceService":
            found += check_operator_rules(doc)
    found += check_ring_rules(docs)
    found += check_secrets(docs, secrets)
    return found
