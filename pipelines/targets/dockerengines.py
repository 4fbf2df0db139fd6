"""The docker target's shared client: each member's Docker engine (unix://, tcp:// or ssh://),
as deploy's backend and the fabric check's launcher both reach it, and the container options
of a launch plan."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pipelines.errors import DeployError, DeployUnreachable
from pipelines.profiles import Profile
from pipelines.targets.ssh import Tunnel

if TYPE_CHECKING:
    from docker import DockerClient


@dataclass(frozen=True)
class MemberHost:
    """One member's Docker host: rank, node and the URL of its engine."""

    rank: int
    node: str
    docker: str


def container_options(plan: dict[str, Any], labels: dict[str, str]) -> dict[str, Any]:
    """Docker SDK `containers.create` options of a launch plan."""
    from docker.types import DeviceRequest, Mount

    options: dict[str, Any] = {
        "environment": plan.get("env", {}),
        "network_mode": plan.get("network_mode", "host"),
        "labels": labels,
        "mounts": [
            Mount(m["target"], m["source"], type="bind", read_only=m.get("read_only", False))
            for m in plan.get("mounts", [])
        ],
    }
    if plan.get("command"):
        options["command"] = plan["command"]
    if plan.get("ipc_mode"):
        options["ipc_mode"] = plan["ipc_mode"]
    if plan.get("devices"):
        options["devices"] = [f"{d}:{d}" for d in plan["devices"]]
    if plan.get("gpus"):
        options["device_requests"] = [DeviceRequest(count=-1, capabilities=[["gpu"]])]
    return options


@dataclass
class DockerEngines:
    """The members' Docker engines: a client per distinct URL, ssh:// through a tunnel."""

    profile: Profile
    local_engines: tuple[str, ...]  # the local stack's engines, one per local_stack member
    _clients: dict[str, DockerClient] = field(default_factory=dict, init=False, repr=False)
    _tunnels: list[Tunnel] = field(default_factory=list, init=False, repr=False)

    def engines(self) -> tuple[str, ...]:
        """Each member's Docker URL: its own, or the local stack's engine."""
        urls = []
        for rank, member in enumerate(self.profile.members):
            local = self.local_engines[rank] if rank < len(self.local_engines) else None
            url = member.docker or (local if self.profile.local_stack else None)
            if url is None:
                raise DeployError(
                    f"profile {self.profile.name}: members.{rank}.docker: no engine (the local"
                    f" stack has {len(self.local_engines)})"
                )
            urls.append(url)
        return tuple(urls)

    def client(self, member: MemberHost) -> DockerClient:
        """The Docker SDK client of a member's engine (one per URL)."""
        import docker
        import docker.errors

        if member.docker not in self._clients:
            url = member.docker
            if url.startswith("ssh://"):
                try:
                    tunnel = Tunnel(url)
                except DeployError as err:
                    raise DeployError(f"member {member.node}: {err}") from None
                self._tunnels.append(tunnel)
                url = tunnel.url
            try:
                client = docker.DockerClient(base_url=url)
                client.ping()
            except docker.errors.DockerException as err:
                raise DeployUnreachable(
                    f"member {member.node}: Docker engine {member.docker} unreachable"
                    f" ({type(err).__name__}); expected a running engine at that URL"
                ) from None
            self._clients[member.docker] = client
        return self._clients[member.docker]

    def close(self) -> None:
        """Close the engines' clients and ssh forwards."""
        for client in self._clients.values():
            client.close()
        for tunnel in self._tunnels:
            tunnel.close()
        self._clients.clear()
        self._tunnels.clear()
