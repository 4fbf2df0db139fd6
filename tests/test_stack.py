"""The local stack: real S3, registry and Docker Engine on 127.0.0.1, no doubles."""

from __future__ import annotations

import hashlib
import io
import os
import re
import shutil
import socket
import stat
import subprocess
import tarfile
import uuid
from collections.abc import Callable
from pathlib import Path

import boto3
import botocore.exceptions
import docker
import pytest
import requests
from botocore.config import Config
from support.ports import spare_stack_ports

import devstack as local_stack

STACK_SCRIPT = local_stack.REPO_ROOT / "scripts" / "stack"
SPARE_ATTEMPTS = 5
EXPORTED_AWS_VARIABLES = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_PROFILE",
    "AWS_DEFAULT_REGION",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
)
MANIFEST_TYPES = ", ".join(
    [
        "application/vnd.docker.distribution.manifest.v2+json",
        "application/vnd.oci.image.manifest.v1+json",
    ]
)


def _stack_processes(directory: Path, program: str) -> list[int]:
    """Pids of live `program` processes whose command line points into directory."""
    inside = f"{directory}/".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b" " in argv[0]:  # retitled into one string (sshd: "sshd: /usr/sbin/sshd -D ...")
            argv = argv[0].split(b" ")[1:]
        if Path(argv[0].decode()).name == program and any(inside in arg for arg in argv):
            found.append(int(entry.name))
    return found


def _spare_vars(directory: Path, endpoints: local_stack.Endpoints) -> dict[str, str]:
    """Variables for a second stack in directory on free ports, reusing the first's engine."""
    s3_port, registry_port, _ = spare_stack_ports()
    return {
        local_stack.STACK_DIR_ENV: str(directory),
        local_stack.S3_PORT_ENV: str(s3_port),
        local_stack.REGISTRY_PORT_ENV: str(registry_port),
        "DOCKER_HOST": endpoints.docker_host,
        # Stack mechanics only: no second engine or sshd (their sockets need short folders).
        local_stack.RING_ENV: "off",
    }


def _collided(directory: Path, error: str) -> bool:
    """Whether a failed `up` in directory failed because another process took a spare port."""
    if "is already in use by another process" in error:
        return True
    # Taken between the stack's check and the service's own bind: the service's log says so.
    logs = directory.glob("*.log")
    return any("address already in use" in log.read_text(errors="replace") for log in logs)


def _on_spare_ports(
    base: Path,
    endpoints: local_stack.Endpoints,
    start: Callable[[Path, dict[str, str]], str | None],
) -> tuple[Path, dict[str, str]]:
    """The folder and variables of a second stack that start(folder, variables) brought up."""
    # Spare ports are only seen free when chosen: another process can bind one before the stack
    # does. Such a collision is retried on other ports, in a fresh folder (its logs tell).
    # start returns None when it got what the test wants, else the error it met.
    for attempt in range(SPARE_ATTEMPTS):
        directory = base / f"stack-{attempt}"
        variables = _spare_vars(directory, endpoints)
        error = start(directory, variables)
        if error is None:
            return directory, variables
        if not _collided(directory, error):
            pytest.fail(error)
    pytest.fail(f"spare ports were taken by other processes {SPARE_ATTEMPTS} times in a row")


def _stack_up(directory: Path, variables: dict[str, str]) -> str | None:
    """`scripts/stack up` for the stack in directory: None, or what it printed on stderr."""
    env = os.environ | variables
    result = subprocess.run(
        [str(STACK_SCRIPT), "up"], env=env, capture_output=True, text=True, timeout=180
    )
    return None if result.returncode == 0 else result.stderr


def _run_stack(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run scripts/stack and return what it printed; fail the test when it fails."""
    result = subprocess.run(
        [str(STACK_SCRIPT), *args], env=env, capture_output=True, text=True, timeout=180
    )
    assert result.returncode == 0, result.stderr
    return result


def _states(status_output: str) -> dict[str, str]:
    """Service name -> state from `scripts/stack status` output."""
    return {line.split()[0]: line.split()[1] for line in status_output.splitlines()}


def _tiny_context(content: bytes) -> io.BytesIO:
    """A build context tar: FROM scratch plus one small file."""
    files = {"Dockerfile": b"FROM scratch\nCOPY tiny.txt /tiny.txt\n", "tiny.txt": content}
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    buffer.seek(0)
    return buffer


def test_the_tests_run_on_a_stack_of_their_own_never_the_users(stack):
    # What `scripts/main` leaves running lives in .stack/ on the default ports: the tests' stack
    # shares none of its folder, ports or engines, and starts its own engine whatever answers.
    ours = local_stack.REPO_ROOT / ".stack-test"
    assert local_stack.default_stack_dir() == ours
    assert "docker" in stack.started
    assert stack.docker_hosts[0] == f"unix://{ours}/docker/docker.sock"
    assert stack.docker_hosts[1].endswith(f"{ours}/docker-b/docker.sock")
    ports = {address.rsplit(":", 1)[1] for address in (stack.s3_url, stack.registry, stack.ssh)}
    assert not ports & {"8333", "5000", "2222"}


def test_up_again_keeps_the_same_single_set_of_services(stack):
    directory = local_stack.default_stack_dir()
    before = {s.name: s.pid for s in local_stack.status()}

    _run_stack("up")

    after = {s.name: s.pid for s in local_stack.status()}
    assert after == before
    assert _stack_processes(directory, "weed") == [before["s3"]]
    assert _stack_processes(directory, "docker-registry") == [before["registry"]]
    engines = [before["docker-b"]] + ([before["docker"]] if "docker" in stack.started else [])
    assert sorted(_stack_processes(directory, "dockerd")) == sorted(engines)
    assert _stack_processes(directory, "sshd") == [before["sshd"]]


def test_s3_object_round_trips_through_the_models_bucket(s3):
    key = f"test-stack/{uuid.uuid4().hex}.bin"
    body = os.urandom(64 * 1024)

    s3.put_object(Bucket="models", Key=key, Body=body)
    try:
        assert s3.get_object(Bucket="models", Key=key)["Body"].read() == body
    finally:
        s3.delete_object(Bucket="models", Key=key)


def test_s3_rejects_a_wrong_secret_and_unsigned_requests(stack):
    credentials = local_stack.s3_credentials()
    wrong = credentials | {"AWS_SECRET_ACCESS_KEY": "0" * 40}
    client = local_stack.s3_client(stack, wrong)

    with pytest.raises(botocore.exceptions.ClientError) as rejected:
        client.put_object(Bucket="models", Key="test-stack/forged", Body=b"x")
    unsigned = requests.put(f"{stack.s3_url}/models/test-stack/anonymous", data=b"x", timeout=10)

    assert rejected.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403
    assert unsigned.status_code == 403


def test_registry_push_then_pull_gives_back_the_registry_digest(stack, docker_client):
    repository = f"{stack.registry}/sparkforge-test/tiny"
    tag = uuid.uuid4().hex[:12]
    image, _ = docker_client.images.build(fileobj=_tiny_context(tag.encode()), custom_context=True)
    image.tag(repository, tag)
    try:
        pushed = list(docker_client.images.push(repository, tag=tag, stream=True, decode=True))
        assert not [line for line in pushed if "error" in line]
        docker_client.images.remove(f"{repository}:{tag}", force=True)
        with pytest.raises(docker.errors.ImageNotFound):
            docker_client.images.get(f"{repository}:{tag}")

        pulled = docker_client.images.pull(repository, tag=tag)
        manifest = requests.get(
            f"http://{stack.registry}/v2/sparkforge-test/tiny/manifests/{tag}",
            headers={"Accept": MANIFEST_TYPES},
            timeout=10,
        )

        digest = manifest.headers["Docker-Content-Digest"]
        assert digest == "sha256:" + hashlib.sha256(manifest.content).hexdigest()
        assert f"{repository}@{digest}" in pulled.attrs["RepoDigests"]
        assert pulled.id == image.id
    finally:
        docker_client.images.remove(image.id, force=True)
        # What the test pushed leaves the shared registry again (deletes are enabled there).
        head = requests.head(
            f"http://{stack.registry}/v2/sparkforge-test/tiny/manifests/{tag}",
            headers={"Accept": MANIFEST_TYPES},
            timeout=10,
        )
        if head.status_code == 200:
            digest = head.headers["Docker-Content-Digest"]
            requests.delete(
                f"http://{stack.registry}/v2/sparkforge-test/tiny/manifests/{digest}", timeout=10
            ).raise_for_status()


def test_docker_build_runs_a_step_whose_file_a_container_reads(docker_client, tmp_path):
    (tmp_path / "bin").mkdir()
    shutil.copy2("/bin/busybox", tmp_path / "bin" / "busybox")
    (tmp_path / "Dockerfile").write_text(
        "FROM scratch\n"
        "COPY bin/busybox /bin/busybox\n"
        'RUN ["/bin/busybox", "sh", "-c", "echo hi from RUN > /hello"]\n'
    )
    image, _ = docker_client.images.build(path=str(tmp_path), network_mode="host", forcerm=True)
    try:
        output = docker_client.containers.run(
            image.id, ["/bin/busybox", "cat", "/hello"], network_mode="host", remove=True
        )
        assert output == b"hi from RUN\n"
    finally:
        docker_client.images.remove(image.id, force=True)


def test_status_lists_every_service_and_no_secret_is_written_anywhere(stack):
    directory = local_stack.default_stack_dir()
    secret = local_stack.s3_credentials()["AWS_SECRET_ACCESS_KEY"]

    result = _run_stack("status")

    states = _states(result.stdout)
    assert list(states) == ["s3", "registry", "docker", "docker-b", "sshd"]
    assert states["s3"] == states["registry"] == "running"
    assert states["docker"] in ("running", "external")
    assert secret not in result.stdout + result.stderr
    assert local_stack.read_endpoints() == stack
    assert secret not in (directory / "endpoints.json").read_text()
    for log in directory.glob("*.log"):
        assert secret not in log.read_text(errors="replace"), log
    credentials_mode = (directory / "s3-credentials.json").stat().st_mode
    assert stat.S_IMODE(credentials_mode) == 0o600


def test_concurrent_ups_start_one_set_of_services(stack, tmp_path):
    def two_ups(directory: Path, variables: dict[str, str]) -> str | None:
        env = os.environ | variables
        ups = [
            subprocess.Popen(
                [str(STACK_SCRIPT), "up"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
            )
            for _ in range(2)
        ]
        errors = [up.communicate(timeout=180)[1].decode() for up in ups]
        failed = [error for up, error in zip(ups, errors, strict=True) if up.returncode != 0]
        if failed:
            # One may have come up after the other met a taken port: both go before a retry.
            _run_stack("down", env=env)
        return failed[0] if failed else None

    spare, variables = _on_spare_ports(tmp_path, stack, two_ups)
    try:
        assert len(_stack_processes(spare, "weed")) == 1
        assert len(_stack_processes(spare, "docker-registry")) == 1
        assert _stack_processes(spare, "dockerd") == []
    finally:
        _run_stack("down", env=os.environ | variables)


def test_down_stops_what_up_started_and_leaves_a_foreign_engine_running(
    stack, docker_client, tmp_path
):
    spare, variables = _on_spare_ports(tmp_path, stack, _stack_up)
    env = os.environ | variables
    assert local_stack.read_endpoints(spare).started == ("s3", "registry")

    _run_stack("down", env=env)
    states = _states(_run_stack("status", env=env).stdout)

    assert states == {
        "s3": "stopped",
        "registry": "stopped",
        "docker": "external",
        "docker-b": "stopped",
        "sshd": "stopped",
    }
    assert docker_client.ping()
    for program in ("weed", "docker-registry", "dockerd", "containerd"):
        assert _stack_processes(spare, program) == [], program
    assert list(spare.glob("*.pid")) == []
    assert not (spare / "endpoints.json").exists()


def test_up_with_a_taken_port_names_it_and_leaves_nothing_running(stack, tmp_path, monkeypatch):
    failures = []

    def up_beside_a_squatter(directory: Path, variables: dict[str, str]) -> str | None:
        for name, value in variables.items():
            monkeypatch.setenv(name, value)
        with socket.socket() as squatter:
            try:
                squatter.bind(("127.0.0.1", int(variables[local_stack.REGISTRY_PORT_ENV])))
            except OSError:
                return "registry port: is already in use by another process, not the squatter"
            squatter.listen()
            try:
                local_stack.up(directory)
            except local_stack.StackError as failure:
                failures.append(failure)
                return None if str(failure).startswith("registry: port") else str(failure)
        return "up succeeded on a taken registry port"

    spare, variables = _on_spare_ports(tmp_path, stack, up_beside_a_squatter)
    registry_port = int(variables[local_stack.REGISTRY_PORT_ENV])

    assert f"registry: port 127.0.0.1:{registry_port} is already in use" in str(failures[-1])
    assert local_stack.REGISTRY_PORT_ENV in str(failures[-1])
    assert [s.state for s in local_stack.status(spare)][:2] == ["stopped", "stopped"]
    assert _stack_processes(spare, "weed") == []


def test_exported_environment_lets_the_standard_aws_chain_reach_s3(stack, monkeypatch):
    for name in EXPORTED_AWS_VARIABLES:
        # Set, then deleted: monkeypatch records each, so the exports are undone afterwards.
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)

    local_stack.export_s3_environment()
    client = boto3.session.Session().client(
        "s3", config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1})
    )

    assert client.head_bucket(Bucket="models")["ResponseMetadata"]["HTTPStatusCode"] == 200


def test_a_disk_short_of_room_stops_the_tests_stack_before_it_starts(tmp_path, monkeypatch):
    # A full disk once showed up as 21 unrelated-looking S3 failures: now it is one line.
    from support import stack as test_stack

    from devstack.settings import StackError

    def must_not_start(*args, **kwargs):
        raise AssertionError("a stack was started on a disk without room")

    monkeypatch.setattr(test_stack, "TEST_STACK_DIR", tmp_path)
    monkeypatch.setattr(test_stack, "NEEDED_FREE", 1 << 60)
    monkeypatch.setattr(test_stack, "start_stack", must_not_start)
    with pytest.raises(StackError) as refused:
        test_stack.session_stack()
    assert re.fullmatch(
        rf"{tmp_path}: \d+\.\d GiB free on its disk, the tests' stack needs 1073741824 GiB: free"
        r" some space \(old clones, /tmp/pytest-of-\*\) and run again",
        str(refused.value),
    )
    assert test_stack.free_space_shortfall(tmp_path, 1 << 20) is None
