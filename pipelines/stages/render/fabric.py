"""The fabric check's documents: a Job per member (Kubernetes) or a launch plan per host (Docker).

Each member runs the all-reduce probe (manifests/fabric/probe.py) the way the runtime starts
its workers: one process per member, the service's image and NCCL environment, host network,
rank 0's management address as rendezvous. Rendering is pure; `check_fabric` proves the env is
the service's, and the rest is validated like every other document.
"""

from __future__ import annotations

from typing import Any

from pipelines.core.paths import FABRIC_PROBE
from pipelines.core.profiles import Profile, required
from pipelines.stages.render import docker, kubernetes
from pipelines.stages.render.documents import (
    Document,
    RenderError,
    RenderInputs,
    render_template,
    template_env,
)
from pipelines.stages.render.validate import (
    check_ring_rules,
    check_secrets,
    env_of,
    validate_documents,
)
from pipelines.stages.render.violations import violation

PROBE_PATH = "/opt/sparkforge/fabric/probe.py"
SWEEP = ("-b", "8M", "-e", "1G", "-f", "2")  # 8 MiB .. 1 GiB, doubling: the busbw plateau
# The check runs beside the deployed service, whose workers hold the rendezvous port itself.
PORT_OFFSET = 100
DEADLINE_S = 900
PREFIX = "fabric-"  # file names: deploy reads `launch-*.yaml` and the kustomization, never these
LABEL = "sparkforge/check"
# Set per member by the operator from spec.multiNode; the Job has no operator, so it sets them.
PER_MEMBER = ("NCCL_IB_HCA", "NCCL_SOCKET_IFNAME", "NCCL_IB_GID_INDEX")
DEBUG = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET"}


def probe_command() -> list[str]:
    """The probe's command line inside the image."""
    return ["python3", PROBE_PATH, *SWEEP]


def is_nccl(name: str) -> bool:
    """An environment variable that shapes NCCL (the fabric env), not a cache or model path."""
    return name.startswith(("NCCL_", "TORCH_NCCL_"))


def rendezvous_env(profile: Profile, rank: int) -> dict[str, str]:
    """Rank and rendezvous as torchrun sets them, at rank 0's management address."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(len(profile.members)),
        "LOCAL_RANK": "0",
        "MASTER_ADDR": str(profile.members[0].address),
        "MASTER_PORT": str(
            required(profile.fabric, "fabric", profile).rendezvous_port + PORT_OFFSET
        ),
    }


def job_env(profile: Profile, rank: int) -> dict[str, str]:
    """A member Job's env: the service's NCCL env, the operator's per-member values, rank."""
    service = {**kubernetes.fabric_env(profile), **profile.env}
    member = profile.members[rank]
    fabric = required(profile.fabric, "fabric", profile)
    env = {k: v for k, v in service.items() if is_nccl(k)}
    env |= {
        "NCCL_IB_HCA": ",".join(fabric.ib_hca),
        "NCCL_SOCKET_IFNAME": member.socket_interface,
        "NCCL_IB_GID_INDEX": str(fabric.ib_gid_index),
        **DEBUG,
        **rendezvous_env(profile, rank),
        "NVIDIA_VISIBLE_DEVICES": "all",
    }
    return dict(sorted(env.items()))


def fabric_jobs(profile: Profile, image: str, probe_source: str) -> list[Document]:
    """The probe's ConfigMap and one Job per member, for a Kubernetes ring."""
    k8s = required(profile.kubernetes, "kubernetes", profile)
    name = f"{k8s.service_name}-fabric"
    labels = {
        "app.kubernetes.io/part-of": "sparkforge",
        "sparkforge/profile": profile.name,
        LABEL: "fabric",
    }
    context: dict[str, Any] = {
        "name": name,
        "namespace": k8s.namespace,
        "labels": labels,
        "image": image,
        "command": probe_command(),
        "probe_source": probe_source,
        "rdma_resource": required(profile.fabric, "fabric", profile).rdma_resource,
        "shm_size": k8s.shm_size,
        "deadline_s": DEADLINE_S,
    }
    env = template_env()
    [configmap] = render_template(env, "fabric/configmap-probe.yaml.j2", context)
    docs = [Document(f"{PREFIX}configmap-{name}-probe.yaml", configmap)]
    for rank, member in enumerate(profile.members):
        member_context = {"rank": rank, "node": member.node, "env": job_env(profile, rank)}
        [job] = render_template(env, "fabric/job.yaml.j2", {**context, "member": member_context})
        docs.append(Document(f"{PREFIX}job-{job['metadata']['name']}.yaml", job))
    return docs


def fabric_plans(profile: Profile, image: str, probe_source: str) -> list[Document]:
    """One launch plan per host for a Docker ring: the member's own plan, running the probe."""
    plans = []
    for doc in docker.launch_plans(profile, image, ["/nonexistent"] * len(profile.members)):
        plan = dict(doc.body)
        rank = plan["rank"]
        # Everything the server's plan has but the model: same image, env, overlay, devices.
        plan["mounts"] = [m for m in plan["mounts"] if m["target"] != "/models"]
        plan["env"] = dict(
            sorted({**plan["env"], **DEBUG, **rendezvous_env(profile, rank)}.items())
        )
        plan["command"] = probe_command()
        plan["files"] = {PROBE_PATH: probe_source}
        plan.pop("port", None)
        plans.append(Document(f"{PREFIX}launch-{rank}-{plan['node']}.yaml", plan))
    return plans


def check_fabric(docs: list[Document]) -> list[str]:
    """Our policy: each fabric member runs with its service's NCCL env, image and host network."""
    found = []
    services = [d for d in docs if d.body.get("kind") == "InferenceService"]
    servers = {d.body["rank"]: d for d in docs if d.file.startswith("launch-")}
    for doc in docs:
        if not doc.file.startswith(PREFIX) or doc.body.get("kind") == "ConfigMap":
            continue
        if doc.body.get("kind") == "Job":
            spec = doc.body["spec"]["template"]["spec"]
            container = spec["containers"][0]
            where: list[str | int] = ["spec", "template", "spec"]
            env, host_net = env_of(container), spec.get("hostNetwork") is True
            if not services:
                found.append(violation(doc.file, [], "a fabric Job needs its service", None))
                continue
            svc = services[0].body["spec"]
            expected = {k: v for k, v in env_of(svc).items() if is_nccl(k)}
            image = svc.get("image")
            got = {k: v for k, v in env.items() if is_nccl(k) and k not in PER_MEMBER}
            got = {k: v for k, v in got.items() if k not in DEBUG or k in expected}
            env_path: list[str | int] = [*where, "containers", 0, "env"]
            image_path: list[str | int] = [*where, "containers", 0, "image"]
            image_found = container.get("image")
        else:
            server = servers.get(doc.body.get("rank"))
            if server is None:
                found.append(violation(doc.file, ["rank"], "no launch plan of that rank", None))
                continue
            env, host_net = doc.body.get("env", {}), doc.body.get("network_mode") == "host"
            expected = {k: v for k, v in server.body["env"].items() if is_nccl(k)}
            got = {k: v for k, v in env.items() if is_nccl(k) and (k not in DEBUG or k in expected)}
            image, image_found = server.body["image"], doc.body.get("image")
            env_path, image_path, where = ["env"], ["image"], []
            overlay = [m for m in server.body["mounts"] if m["target"] != "/models"]
            if [m for m in doc.body.get("mounts", []) if m in overlay] != overlay:
                found.append(
                    violation(doc.file, ["mounts"], "must mount the server's NCCL library", None)
                )
        if got != expected:
            diff = sorted(set(got.items()) ^ set(expected.items()))
            found.append(
                violation(doc.file, env_path, "NCCL env must be the service's", diff[0][0])
            )
        if image_found != image:
            found.append(
                violation(doc.file, image_path, "must be the service's image", image_found)
            )
        if not host_net:
            found.append(violation(doc.file, where, "must run on the host network", None))
        if any(env.get(k) != v for k, v in DEBUG.items()):
            found.append(
                violation(
                    doc.file, env_path, "needs NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET", None
                )
            )
    return found


def with_fabric(docs: list[Document], fabric: list[Document], lines: list[str]) -> list[Document]:
    """The documents with the fabric check's added, once those pass their layers and our policy."""
    lines = lines + check_fabric(docs + fabric)
    if lines:
        raise RenderError("\n".join(lines))
    return [*docs, *fabric]


def kubernetes_with_fabric(
    profile: Profile, model: RenderInputs, secrets: list[str]
) -> list[Document]:
    """tp3-ring: the llmkube documents, then the fabric Jobs (outside the kustomization)."""
    docs = kubernetes.render(profile, model, secrets)
    fabric = fabric_jobs(profile, model.image, FABRIC_PROBE.read_text())
    return with_fabric(docs, fabric, validate_documents(fabric, secrets))


def docker_with_fabric(profile: Profile, model: RenderInputs, secrets: list[str]) -> list[Document]:
    """tp4-ring: the launch plans, then one fabric launch plan per host."""
    docs = docker.render(profile, model, secrets)
    fabric = fabric_plans(profile, model.image, FABRIC_PROBE.read_text())
    return with_fabric(docs, fabric, check_ring_rules(fabric) + check_secrets(fabric, secrets))
