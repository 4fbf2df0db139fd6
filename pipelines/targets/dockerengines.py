"""The docker target's shared client: each member's Docker engine (unix://, ssh://, or tcp://
with verified TLS only), as deploy's backend and the fabric check's launcher both reach it, and
the container options of a launch plan."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipelines.core.errors import BadInput, DeployError, DeployUnreachable
from pipelines.core.profiles import Profile
from pipelines.targets.pruning import Stray
from pipelines.targets.ssh import Tunnel

if TYPE_CHECKING:
    from docker import DockerClient
    from docker.models.containers import Container
    from docker.tls import TLSConfig

# What the docker CLI reads from DOCKER_CERT_PATH for `--tlsverify`.
TLS_FILES = ("ca.pem", "cert.pem", "key.pem")
# Any version the SDK accepts: used for the one /version request that finds the engine's own.
PROBE_API_VERSION = "1.24"


class EngineBadInput(DeployError, BadInput):
    """A member's engine URL that may not be used as it is (tcp:// without verified TLS)."""


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

    def pull(self, client: DockerClient, member: MemberHost, image: str) -> None:
        """Have the member's engine hold the image (pulled by digest when missing)."""
        import docker.errors

        try:
            client.images.get(image)
        except docker.errors.ImageNotFound:
            try:
                client.images.pull(image)
            except docker.errors.DockerException as err:
                raise DeployError(
                    f"member {member.node}: {member.docker} cannot pull {image}: {err}"
                ) from None

    def client(self, member: MemberHost) -> DockerClient:
        """The Docker SDK client of a member's engine (one per URL)."""
        import docker
        import docker.errors
        import requests

        if member.docker not in self._clients:
            url = member.docker
            if url.startswith("ssh://"):
                try:
                    tunnel = Tunnel(url)
                except DeployError as err:
                    raise DeployError(f"member {member.node}: {err}") from None
                self._tunnels.append(tunnel)
                url = tunnel.url
            tls = engine_tls(member) if member.docker.startswith("tcp://") else None
            try:
                client = tls_client(url, tls) if tls else docker.DockerClient(base_url=url)
                client.ping()
            except (docker.errors.DockerException, requests.RequestException) as err:
                # requests' own (an SSLError of an engine another CA signed) are not wrapped.
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


def labelled_containers(
    engines: DockerEngines, urls: Iterable[str], labels: dict[str, str | None]
) -> Iterator[tuple[str, Container]]:
    """(engine, container) for each named container on these engines that carries labels (None:
    any value), in name order; the engine's filtering is checked here again (its answer is not
    trusted to have filtered)."""
    import docker.errors

    selector = [key if value is None else f"{key}={value}" for key, value in labels.items()]
    for url in dict.fromkeys(urls):
        client = engines.client(MemberHost(-1, "engine", url))
        try:
            listed = client.containers.list(all=True, filters={"label": selector})
        except docker.errors.DockerException as err:
            raise DeployError(f"engine {url}: listing containers: {err}") from None
        for container in sorted(listed, key=lambda c: c.name or ""):
            carried = container.labels
            if container.name and all(
                key in carried and value in (None, carried[key]) for key, value in labels.items()
            ):
                yield url, container


def remove_strays(engines: DockerEngines, strays: list[Stray]) -> list[str]:
    """Remove each stray container (entry: engine, container); one line per one that could not
    be removed (gone already is fine)."""
    import docker.errors
    import requests

    failed = []
    for stray in strays:
        url, name = stray.entry["engine"], stray.entry["container"]
        try:
            engines.client(MemberHost(-1, "engine", url)).containers.get(name).remove(force=True)
        except docker.errors.NotFound:
            pass
        except (DeployError, docker.errors.DockerException, requests.RequestException) as err:
            failed.append(f"{stray.what}: not removed: {err}")
    return failed


def engine_tls(member: MemberHost) -> TLSConfig:
    """TLS for a tcp:// engine, as the docker CLI reads it: DOCKER_TLS_VERIFY set and the CA,
    client certificate and key in DOCKER_CERT_PATH (default ~/.docker). Refused without: a
    launch plan's env (ring staging's S3 keys) would cross the network in the clear."""
    from docker.tls import TLSConfig

    where = f"member {member.node}: Docker engine {member.docker}"
    if not os.environ.get("DOCKER_TLS_VERIFY"):
        raise EngineBadInput(
            f"{where}: tcp:// without TLS refused (container env would cross in the clear);"
            " expected DOCKER_TLS_VERIFY=1 with ca.pem, cert.pem and key.pem in"
            " DOCKER_CERT_PATH, or an ssh:// URL"
        )
    folder = Path(os.environ.get("DOCKER_CERT_PATH") or Path.home() / ".docker")
    missing = [name for name in TLS_FILES if not (folder / name).is_file()]
    if missing:
        raise EngineBadInput(
            f"{where}: DOCKER_TLS_VERIFY is set but DOCKER_CERT_PATH {folder} lacks"
            f" {', '.join(missing)}; expected ca.pem, cert.pem and key.pem"
        )
    ca, cert, key = (str(folder / name) for name in TLS_FILES)
    return TLSConfig(client_cert=(cert, key), ca_cert=ca, verify=True)


def tls_client(url: str, tls: TLSConfig) -> DockerClient:
    """A client that verifies the engine against DOCKER_CERT_PATH's CA alone: requests would
    let REQUESTS_CA_BUNDLE or CURL_CA_BUNDLE replace it (trust_env), so env is not read."""
    import docker

    # A fixed version makes no request on creation; the engine's own is asked for once the
    # session ignores the environment, then used as the SDK's `auto` would.
    probe = docker.APIClient(base_url=url, tls=tls, version=PROBE_API_VERSION)
    probe.trust_env = False
    try:
        version = str(probe.version(api_version=False)["ApiVersion"])
    finally:
        probe.close()
    client = docker.DockerClient(base_url=url, tls=tls, version=version)
    client.api.trust_env = False
    return client
