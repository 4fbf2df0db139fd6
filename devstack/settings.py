"""What the stack is: its folder, ports, endpoints and states, read from the environment."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from pipelines.core.errors import PipelineError, Unreachable

STACK_DIR_ENV = "SPARKFORGE_STACK_DIR"
S3_PORT_ENV = "SPARKFORGE_S3_PORT"
REGISTRY_PORT_ENV = "SPARKFORGE_REGISTRY_PORT"
SSH_PORT_ENV = "SPARKFORGE_SSH_PORT"
REPO_ROOT = Path(__file__).resolve().parent.parent

HOST = "127.0.0.1"
S3_REGION = "us-east-1"
BUCKETS = ("models",)
DEFAULT_S3_PORT = 8333
DEFAULT_REGISTRY_PORT = 5000
DEFAULT_SSH_PORT = 2222
SYSTEM_DOCKER_HOST = "unix:///var/run/docker.sock"
ENGINE_ENV = "SPARKFORGE_STACK_ENGINE"  # "own": start the stack's engine even if one answers
# "off": no second engine and no sshd (a stack for S3, registry and one engine only).
RING_ENV = "SPARKFORGE_STACK_RING"
RING_SERVICES = ("docker-b", "sshd")


class StackError(PipelineError):
    """A stack service could not be started, reached or stopped (one line, never a secret)."""


class StackDown(StackError, Unreachable):
    """The stack is not up: no endpoints.json for a task that needs its services."""


@dataclass(frozen=True)
class Endpoints:
    """Where the stack's services answer; what `up` returns and writes to endpoints.json."""

    s3_url: str
    s3_region: str
    registry: str
    docker_host: str
    # The services this stack runs itself, which `down` stops; "docker" is missing when an
    # engine was already reachable and is only used.
    started: tuple[str, ...]
    s3_buckets: tuple[str, ...] = BUCKETS
    # Engines standing in for the hosts of a ring, in member order: the first engine, then
    # the stack's second one reached over ssh (ssh://user@127.0.0.1:port/socket).
    docker_hosts: tuple[str, ...] = ()
    # The stack's sshd (host:port), the key it made for it, the known_hosts naming it.
    ssh: str = ""
    ssh_identity: str = ""
    ssh_known_hosts: str = ""


@dataclass(frozen=True)
class ServiceStatus:
    """One service as `status` sees it: state is running, unhealthy, stopped or external."""

    name: str
    state: str
    endpoint: str
    pid: int | None

    def line(self) -> str:
        """The line `scripts/stack status` prints."""
        pid = self.pid if self.pid is not None else "-"
        return f"{self.name:<9} {self.state:<10} {self.endpoint:<48} pid={pid}"


@dataclass(frozen=True)
class Settings:
    """The stack folder and the ports asked for through the environment."""

    directory: Path
    s3_port: int
    registry_port: int
    ssh_port: int = DEFAULT_SSH_PORT

    @property
    def s3_url(self) -> str:
        """The S3 endpoint URL."""
        return f"http://{HOST}:{self.s3_port}"

    @property
    def registry(self) -> str:
        """The registry as host:port, the form image references use."""
        return f"{HOST}:{self.registry_port}"

    @property
    def own_docker_host(self) -> str:
        """The Docker host URL of the engine this stack starts when none is reachable."""
        return f"unix://{docker_socket(self.directory)}"

    @property
    def second_docker_host(self) -> str:
        """The stack's second engine, on its own socket and data root (a second host)."""
        return f"unix://{docker_socket(self.directory, 'docker-b')}"

    @property
    def ssh(self) -> str:
        """The stack's sshd as host:port."""
        return f"{HOST}:{self.ssh_port}"

    def ssh_docker_host(self, user: str) -> str:
        """The second engine as a ring member reaches it: over ssh, to its socket."""
        return f"ssh://{user}@{self.ssh}{docker_socket(self.directory, 'docker-b')}"


def default_stack_dir() -> Path:
    """The stack folder: $SPARKFORGE_STACK_DIR, else `.stack/` in the checkout."""
    return Path(os.environ.get(STACK_DIR_ENV) or REPO_ROOT / ".stack").absolute()


def resolve_dir(stack_dir: Path | str | None = None) -> Path:
    """The given stack folder as an absolute path, or the default one."""
    return Path(stack_dir).absolute() if stack_dir is not None else default_stack_dir()


def settings(stack_dir: Path | str | None = None) -> Settings:
    """The stack folder and ports, read from the environment now."""
    return Settings(
        directory=resolve_dir(stack_dir),
        s3_port=_port_from_env(S3_PORT_ENV, DEFAULT_S3_PORT),
        registry_port=_port_from_env(REGISTRY_PORT_ENV, DEFAULT_REGISTRY_PORT),
        ssh_port=_port_from_env(SSH_PORT_ENV, DEFAULT_SSH_PORT),
    )


def _port_from_env(name: str, default: int) -> int:
    """A TCP port from environment variable `name`, or `default` when it is unset."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    if not raw.isdigit() or not 1024 <= int(raw) <= 55535:
        raise StackError(f"{name}={raw!r}: expected a port number from 1024 to 55535")
    return int(raw)


def s3_ports(s3_port: int) -> dict[str, int]:
    """Every TCP port `weed mini` opens, derived from the S3 port so one setting moves all."""
    return {
        "s3": s3_port,
        "master": s3_port + 1,
        "volume": s3_port + 2,
        "filer": s3_port + 3,
        "admin": s3_port + 4,
        "master.grpc": s3_port + 5,
        "volume.grpc": s3_port + 6,
        "filer.grpc": s3_port + 7,
        "s3.grpc": s3_port + 8,
        # weed's embedded worker dials the admin gRPC port as admin port + 10000 whatever
        # -admin.port.grpc says, so that offset is the only one that works.
        "admin.grpc": s3_port + 4 + 10000,
    }


def docker_socket(directory: Path, name: str = "docker") -> Path:
    """The API socket of an engine this stack starts (`docker`, or the second, `docker-b`)."""
    return directory / name / "docker.sock"
