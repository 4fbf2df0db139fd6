"""The stack's commands: up, down and status over the table of services."""

from __future__ import annotations

import getpass
import os
import socket
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from devstack import files, processes
from devstack.engines import engine_answers, ssh_files
from devstack.services import SERVICES, Service
from devstack.settings import (
    ENGINE_ENV,
    HOST,
    RING_ENV,
    RING_SERVICES,
    S3_REGION,
    SYSTEM_DOCKER_HOST,
    Endpoints,
    ServiceStatus,
    Settings,
    StackError,
    resolve_dir,
    settings,
)

START_TIMEOUT = 60.0


def _running_pid(directory: Path, name: str) -> int | None:
    """The pid of this stack's `name` service when it is alive, else None."""
    return processes.running_pid(directory, name, SERVICES[name].marker(directory))


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


def _start(cfg: Settings, service: Service, credentials: Mapping[str, str]) -> None:
    """Launch one service after checking that its ports are free."""
    command = service.command(cfg, credentials)
    busy = _busy_ports(command.ports)
    if busy:
        raise StackError(
            f"{service.name}: port {HOST}:{busy[0]} is already in use by another process; "
            f"set {service.port_env} to move it"
        )
    processes.launch(cfg.directory, service.name, command)


def _wait_ready(cfg: Settings, service: Service, credentials: Mapping[str, str]) -> None:
    """Wait until the service answers and is ready, or fail naming its log."""
    name, endpoint = service.name, service.endpoint(cfg)
    log = files.log_file(cfg.directory, name)
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if _running_pid(cfg.directory, name) is None:
            code = processes.exit_code(cfg.directory, name)
            raise StackError(f"{name} exited while starting (code {code}); see {log}")
        if service.answers(endpoint) and service.ready(endpoint, credentials):
            return
        time.sleep(processes.POLL_SECONDS)
    raise StackError(
        f"{name} did not become healthy at {endpoint} in {START_TIMEOUT:.0f} s; see {log}"
    )


def _stop(directory: Path, names: Iterable[str]) -> None:
    """Stop this stack's services among names, drop their pid files, clear what they left."""
    names = [name for name in names if files.pid_file(directory, name).exists()]
    running = {name: pid for name in names if (pid := _running_pid(directory, name))}
    processes.terminate(running)
    for name in names:
        files.pid_file(directory, name).unlink(missing_ok=True)
        processes.forget(running.get(name))
    for name in names:
        SERVICES[name].cleanup(directory)


def _external_engine(cfg: Settings) -> str | None:
    """A reachable engine this stack did not start ($DOCKER_HOST, else the system socket).

    None with SPARKFORGE_STACK_ENGINE=own: the tests that wipe an engine need the stack's own.
    """
    if os.environ.get(ENGINE_ENV) == "own":
        return None
    configured = os.environ.get("DOCKER_HOST", "").strip()
    # A DOCKER_HOST exported from this stack's own endpoints means "ours", not "theirs".
    if configured and configured != cfg.own_docker_host:
        if not engine_answers(configured):
            raise StackError(
                f"docker: DOCKER_HOST={configured} does not answer /_ping; "
                "start that engine or unset DOCKER_HOST to let the stack start its own"
            )
        return configured
    return SYSTEM_DOCKER_HOST if engine_answers(SYSTEM_DOCKER_HOST) else None


def _check_recorded_ports(cfg: Settings) -> None:
    """Refuse to `up` on other ports than the ones this stack's running services use."""
    recorded = files.recorded_endpoints(cfg.directory)
    if recorded is None:
        return
    for service in SERVICES.values():
        was, wanted = service.recorded(recorded), service.endpoint(cfg)
        if was is not None and was != wanted and _running_pid(cfg.directory, service.name):
            raise StackError(
                f"{service.name} already runs at {was} from {cfg.directory}, but "
                f"{service.port_env} asks for {wanted}; run `scripts/stack down` first"
            )


def up(stack_dir: Path | str | None = None) -> Endpoints:
    """Start what is not running yet, wait until everything answers, write endpoints.json."""
    cfg = settings(stack_dir)
    cfg.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    with files.locked(cfg.directory):
        credentials = files.ensure_credentials(cfg.directory)
        _check_recorded_ports(cfg)
        docker_host = cfg.own_docker_host
        ring = os.environ.get(RING_ENV) != "off"
        ours = [name for name in SERVICES if ring or name not in RING_SERVICES]
        if not _running_pid(cfg.directory, "docker"):
            external = _external_engine(cfg)
            if external:
                docker_host, ours = external, [name for name in ours if name != "docker"]
        launched = []
        try:
            for name in ours:
                if not _running_pid(cfg.directory, name):
                    _start(cfg, SERVICES[name], credentials)
                    launched.append(name)
            # Launched all first, waited after: the services start in parallel.
            for name in ours:
                _wait_ready(cfg, SERVICES[name], credentials)
        except BaseException:
            # Nothing half-started is left behind; what already ran before stays.
            _stop(cfg.directory, launched)
            raise
        endpoints = Endpoints(
            s3_url=cfg.s3_url,
            s3_region=S3_REGION,
            registry=cfg.registry,
            docker_host=docker_host,
            started=tuple(ours),
            **(_ring_endpoints(cfg, docker_host) if ring else {"docker_hosts": (docker_host,)}),
        )
        files.write_endpoints(cfg.directory, endpoints)
    return endpoints


def _ring_endpoints(cfg: Settings, docker_host: str) -> dict[str, Any]:
    """The engines by member (the first, then the second over ssh) and the ssh files."""
    files_ = ssh_files(cfg.directory)
    return {
        "docker_hosts": (docker_host, cfg.ssh_docker_host(getpass.getuser())),
        "ssh": cfg.ssh,
        "ssh_identity": str(files_["identity"]),
        "ssh_known_hosts": str(files_["known_hosts"]),
    }


def down(stack_dir: Path | str | None = None, services: Iterable[str] | None = None) -> None:
    """Stop the services this stack started (all, or just `services`); never a foreign engine."""
    directory = resolve_dir(stack_dir)
    names = list(SERVICES if services is None else services)
    unknown = sorted(set(names) - set(SERVICES))
    if unknown:
        raise StackError(f"unknown service {unknown[0]!r}: expected one of {', '.join(SERVICES)}")
    if not directory.is_dir():
        return
    with files.locked(directory):
        _stop(directory, names)
        still = tuple(name for name in SERVICES if _running_pid(directory, name))
        recorded = files.recorded_endpoints(directory)
        if not still:
            files.forget_endpoints(directory)
        elif recorded is not None:
            files.write_endpoints(directory, Endpoints(**{**asdict(recorded), "started": still}))


def status(stack_dir: Path | str | None = None) -> list[ServiceStatus]:
    """One ServiceStatus per service: running, unhealthy, stopped, or external (docker)."""
    cfg = settings(stack_dir)
    recorded = files.recorded_endpoints(cfg.directory)
    result = []
    for name, service in SERVICES.items():
        pid = _running_pid(cfg.directory, name)
        if pid is None and name == "docker":
            result.append(_foreign_engine_status(cfg))
            continue
        # Where the last `up` put it, which the environment may since have changed.
        endpoint = (recorded and service.recorded(recorded)) or service.endpoint(cfg)
        if pid is None:
            state = "stopped"
        else:
            state = "running" if service.answers(endpoint) else "unhealthy"
        result.append(ServiceStatus(name, state, endpoint, pid))
    return result


def _foreign_engine_status(cfg: Settings) -> ServiceStatus:
    """The docker line when this stack runs no engine: an external one, or stopped."""
    configured = os.environ.get("DOCKER_HOST", "").strip()
    for host in (configured, SYSTEM_DOCKER_HOST):
        if host and host != cfg.own_docker_host and engine_answers(host):
            return ServiceStatus("docker", "external", host, None)
    return ServiceStatus("docker", "stopped", cfg.own_docker_host, None)
