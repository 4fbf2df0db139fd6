"""The Kubernetes renderer (tp3-ring): llmkube manifests from profile, lock and image digest.

Rendering is pure: profile, lock and image digest in, documents out; validate.py checks them.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pipelines.core.modellock import Lock, cache_key
from pipelines.core.profiles import Profile, required
from pipelines.core.schema import as_data
from pipelines.stages.render.documents import (
    Document,
    RenderError,
    RenderInputs,
    render_template,
    template_env,
)
from pipelines.stages.render.validate import validate_documents

CACHE_ROOT = "/cache"  # one hostPath volume for every JIT/compile cache (survives reboots)
STAGING_CACHE = "/models"  # where a staging Job mounts its member's model cache claim
STAGING_COMPONENT = "weights-staging"  # the staging objects' app.kubernetes.io/component
# Pod template annotations: a Job is replaced only when its own body changes (a Job's template
# is immutable), so what a Job's work depends on beyond its body must be hashed into it.
PLAN_ANNOTATION = "sparkforge.dev/ring-plan-sha256"
STAGE_JOB_ANNOTATION = "sparkforge.dev/stage-job-sha256"
# In the group's env: the ring plan its members' weights were staged by.
WEIGHTS_ENV = "SPARKFORGE_RING_PLAN_SHA256"


def fabric_env(profile: Profile) -> dict[str, str]:
    """The NCCL environment of a vLLM ring member, computed from the topology.

    Switchless rings cannot close a cycle with NCCL's default NIC pairing: an odd ring dies in
    channel setup without subnet-aware routing, so every ring of three or more gets it.
    """
    env = {
        "NCCL_NET": "IB",
        "NCCL_IB_DISABLE": "0",
        "NCCL_IB_ROCE_VERSION_NUM": "2",
        "NCCL_IB_ADDR_FAMILY": "AF_INET",
        "NCCL_IB_TC": "106",
        "NCCL_IB_TIMEOUT": "22",
        "NCCL_NET_PLUGIN": "none",
        "NCCL_NVLS_ENABLE": "0",
        "NCCL_CUMEM_ENABLE": "0",
        "NCCL_IGNORE_CPU_AFFINITY": "1",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "NCCL_DEBUG": "INFO",
        "NCCL_DEBUG_SUBSYS": "INIT,NET",
    }
    if len(profile.members) >= 3:
        env["NCCL_IB_SUBNET_AWARE_ROUTING"] = "1"
        env["NCCL_IB_MERGE_NICS"] = "0"
    return env


def cache_env() -> dict[str, str]:
    """Every JIT/compile cache under one folder, so a reboot does not recompile."""
    return {
        "HF_HOME": f"{CACHE_ROOT}/huggingface",
        "VLLM_CACHE_ROOT": f"{CACHE_ROOT}/vllm",
        "TRITON_CACHE_DIR": f"{CACHE_ROOT}/triton",
        "TORCHINDUCTOR_CACHE_DIR": f"{CACHE_ROOT}/inductor",
        "CUDA_CACHE_PATH": f"{CACHE_ROOT}/cuda",
    }


def vllm_args(profile: Profile) -> list[str]:
    """The vLLM arguments of the service: served name, batch shape, speculation, extras."""
    v = required(profile.vllm, "vllm", profile)
    args = [
        f"--served-model-name={profile.model.served_name}",
        f"--block-size={v.block_size}",
        f"--max-num-seqs={v.max_num_seqs}",
        f"--max-num-batched-tokens={v.max_num_batched_tokens}",
    ]
    if v.speculative:
        spec = {
            "method": v.speculative.method,
            "num_speculative_tokens": v.speculative.num_speculative_tokens,
        }
        args.append("--speculative-config=" + json.dumps(spec, sort_keys=True))
    return args + list(v.extra_args)


def staging_context(
    labels: dict[str, str], staging: tuple[str, str] | None
) -> dict[str, Any] | None:
    """What the ring staging templates read: (stager image, plan JSON), or None: no staging."""
    if staging is None:
        return None
    image, plan = staging
    digest = hashlib.sha256(plan.encode()).hexdigest()
    return {
        "image": image,
        "plan": plan,
        "plan_sha256": digest,
        # A new lock changes only the plan's ConfigMap: without its hash in the Job, the
        # Complete stage Jobs would stay and the ring would keep serving the old bytes.
        "annotations": {PLAN_ANNOTATION: digest},
        "cache": STAGING_CACHE,
        # Blobs beside the model folders, on the claim's filesystem (staging links, never copies).
        "root": f"{STAGING_CACHE}/.sparkforge",
        "labels": {**labels, "app.kubernetes.io/component": STAGING_COMPONENT},
    }


def body_sha256(body: dict[str, Any]) -> str:
    """The sha256 of a document's body as canonical JSON."""
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def render_context(
    profile: Profile,
    lock: Lock,
    image: str,
    patch_source: str,
    staging: tuple[str, str] | None = None,
) -> dict[str, Any]:
    """Everything the templates read, computed from profile, lock and image (pure)."""
    key = cache_key(lock.source)
    k8s = required(profile.kubernetes, "kubernetes", profile)
    vllm = required(profile.vllm, "vllm", profile)
    fabric = required(profile.fabric, "fabric", profile)
    labels = {"app.kubernetes.io/part-of": "sparkforge", "sparkforge/profile": profile.name}
    stage = staging_context(labels, staging)
    env = {
        **fabric_env(profile),
        **profile.env,
        **cache_env(),
        "CUDA_EXL3_MODEL_PATH": f"/models/{key}",
        # New bytes under the same file names change no other field of the group, which would
        # serve on from what it loaded (reading Engram rows from the new files): naming the
        # plan here recreates the group whenever the stage Jobs run again.
        **({WEIGHTS_ENV: stage["plan_sha256"]} if stage else {}),
    }
    return {
        "namespace": k8s.namespace,
        "labels": labels,
        "staging": stage,
        "model": {
            "key": key,
            "name": profile.model.lock,
            "source": lock.source,
            "files": [e.name for e in lock.files],
            "secret": profile.model.source_secret,
            "format": profile.model.format,
            "quantization": profile.model.quantization,
            "path": f"/models/{key}",
        },
        "service": {
            "name": k8s.service_name,
            "runtime": profile.runtime,
            "image": image,
            "resources": as_data(profile.resources),
            "env": dict(sorted(env.items())),
            "extra_args": vllm_args(profile),
            "tensor_parallel": profile.parallel.tensor,
            "pipeline_parallel": profile.parallel.pipeline,
            "gpu_memory_utilization": vllm.gpu_memory_utilization,
            "max_model_len": vllm.max_model_len,
        },
        "fabric": as_data(fabric),
        "members": [
            {
                "rank": rank,
                "node": m.node,
                "address": str(m.address),
                "socket_interface": m.socket_interface,
                "ib_hca": ",".join(fabric.ib_hca),
                "claim": m.claim,
            }
            for rank, m in enumerate(profile.members)
        ],
        "cache": {
            "size": k8s.cache_size,
            "storage_class": k8s.storage_class,
            "node_path": k8s.node_cache_path,
            "jit_root": CACHE_ROOT,
            "jit_node_path": k8s.node_jit_cache_path,
            "shm_size": k8s.shm_size,
        },
        "hygiene": as_data(required(profile.hygiene, "hygiene", profile)),
        "patch_source": patch_source,
    }


def render_kubernetes(
    profile: Profile,
    lock: Lock,
    image: str,
    patch_source: str,
    staging: tuple[str, str] | None = None,
) -> list[Document]:
    """The llmkube documents of a profile, in the order they must be applied; with staging
    (stager image, ring plan), each member's ring staging Job before the Model."""
    env = template_env()
    context = render_context(profile, lock, image, patch_source, staging)
    docs: list[Document] = []

    def add(prefix: str, template: str, extra: dict[str, Any] | None = None) -> None:
        for body in render_template(env, template, {**context, **(extra or {})}):
            name = f"{prefix}-{body['kind'].lower()}-{body['metadata']['name']}.yaml"
            docs.append(Document(name, body))

    # Apply order, as pipelines/profiles/FACTS.md has it: caches, the Model (staging), the TP3
    # patch on every member's copy, node prep (drop the page cache the stage left), then the
    # group. Ring staging fills every member's cache before the Model, which then finds the
    # files there.
    if profile.model.config_patch == "tp3-heads":
        add("10", "configmap-tp3-patch.yaml.j2")
    if staging:
        add("10", "configmap-ring-plan.yaml.j2")
    for member in context["members"]:
        add("20", "member-cache.yaml.j2", {"member": member})
    # Per member, what its later Jobs carry of its stage Job: they run again whenever it does.
    staged: dict[int, dict[str, str]] = {}
    if staging:
        for member in context["members"]:
            add("25", "job-stage-weights.yaml.j2", {"member": member})
            staged[member["rank"]] = {STAGE_JOB_ANNOTATION: body_sha256(docs[-1].body)}
    add("30", "model.yaml.j2")
    if profile.model.config_patch == "tp3-heads":
        for member in context["members"]:
            # A re-run stage Job re-links the unpadded config.json: the patch must run again.
            annotations = staged.get(member["rank"], {})
            add("40", "job-tp3-patch.yaml.j2", {"member": member, "annotations": annotations})
    for member in context["members"]:
        # A re-stage leaves the new bytes as page cache: node prep must run again after it.
        annotations = staged.get(member["rank"], {})
        add("50", "job-node-prep.yaml.j2", {"member": member, "annotations": annotations})
    add("60", "inferenceservice.yaml.j2")
    return docs


def kustomization(docs: list[Document]) -> Document:
    """The kustomization listing the documents in apply order."""
    body = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [d.file for d in docs],
    }
    return Document("kustomization.yaml", body)


def render(profile: Profile, model: RenderInputs, secrets: list[str]) -> list[Document]:
    """Render, validate (raising with one line per violation), then add the kustomization."""
    staging = (model.stager_image, model.ring_plan) if model.ring_plan else None
    docs = render_kubernetes(profile, model.lock, model.image, model.patch_source, staging)
    violations = validate_documents(docs, secrets)
    if violations:
        raise RenderError("\n".join(violations))
    return [*docs, kustomization(docs)]
