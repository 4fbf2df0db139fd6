"""Preflight on Docker hosts: the checks of preflight.py run in each member's own image on its
own engine (disk, swap, GPUs, the fabric's devices), nothing of a deployment touched."""

from __future__ import annotations

import json

from pipelines.core.errors import DeployError
from pipelines.stages.deploy import preflight
from pipelines.stages.deploy.plan import Deployment
from pipelines.stages.deploy.preflight import member_needs
from pipelines.targets.dockerengines import DockerEngines


def docker_preflight(
    hosts: DockerEngines,
    rdma_sysfs: str | None,
    deployment: Deployment,
    swap_off: bool,
    min_free: int,
    lock_sha256: str,
) -> list[str]:
    """Problems on any member (one line each), found without touching a deployment: the
    preflight script run in the member's image, on its engine."""
    import docker.errors
    from docker.types import Mount

    ring_only = bool(hosts.profile.fabric and hosts.profile.fabric.patched_nccl)
    rdma = "/rdma" if rdma_sysfs else preflight.RDMA_SYSFS
    fabric = preflight.fabric_needs(hosts.profile.fabric, rdma)
    found, nccl = [], {}
    for member, plan in deployment.members():
        needs = member_needs(plan, swap_off, min_free, lock_sha256, ring_only, fabric)
        if fabric and rdma_sysfs:
            needs.mounts.append((rdma, rdma_sysfs))
        try:
            client = hosts.client(member)
            hosts.pull(client, member, plan["image"])
            output = client.containers.run(
                plan["image"],
                ["python3", "-c", preflight.SCRIPT, json.dumps(needs.args)],
                entrypoint=[],
                remove=True,
                # The host's: a netdev's MTU is in the sysfs of the network namespace it is in.
                network_mode="host" if fabric else "none",
                mounts=[Mount(t, s, type="bind", read_only=True) for t, s in needs.mounts],
            )
        except DeployError as err:
            found.append(str(err))
            continue
        except docker.errors.DockerException as err:
            found.append(f"member {member.node}: preflight on {member.docker}: {err}")
            continue
        problems, nccl_sha = preflight.read_answer(output)
        found += [f"member {member.node}: {line}" for line in problems]
        if nccl_sha:
            nccl[member.node] = nccl_sha
    overlay = hosts.profile.sglang.nccl_overlay if hosts.profile.sglang else None
    return found + preflight.nccl_disagreements(nccl, overlay.sha256 if overlay else None)
