"""Pushing to a registry that wants a login, with credentials from the Docker chain."""

from __future__ import annotations

import base64
import io
import json
import os
import tarfile
import uuid

import bcrypt
import pytest
from support.registry_server import start_registry

from pipelines.stages.images.oci import assemble, write_layer
from pipelines.stages.images.registry import Registry
from pipelines.stages.images.registry_push import push_image
from pipelines.stages.images.spec import ImageError

USER = "sparkforge-ci"


@pytest.fixture
def locked_registry(tmp_path):
    """Debian's docker-registry on loopback with htpasswd (Basic) auth; (host, password)."""
    password = uuid.uuid4().hex
    (tmp_path / "htpasswd").write_bytes(
        f"{USER}:".encode() + bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=5)) + b"\n"
    )
    htpasswd = {"realm": "sparkforge-test", "path": str(tmp_path / "htpasswd")}
    proc, host = start_registry(tmp_path, {"auth": {"htpasswd": htpasswd}})
    yield host, password
    proc.terminate()
    proc.wait(timeout=10)


def tiny_image(folder):
    """A one-layer image holding one file, made without an engine."""
    data = b"hello from sparkforge\n"
    info = tarfile.TarInfo("hello.txt")
    info.size = len(data)
    layer, diff_id = write_layer([(info, io.BytesIO(data))], folder)
    config = {
        "architecture": "amd64",
        "os": "linux",
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
    }
    return assemble(config, [layer], folder)


def test_push_without_credentials_says_how_to_log_in(locked_registry, tmp_path, monkeypatch):
    host, password = locked_registry
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "empty"))
    with pytest.raises(ImageError) as err:
        push_image(Registry(host), "sparkforge/tiny", tiny_image(tmp_path), ["t"])
    assert f"registry {host} wants credentials" in str(err.value)
    assert f"docker login {host}" in str(err.value)


def test_push_logs_in_from_docker_config_and_never_shows_the_secret(
    locked_registry, tmp_path, monkeypatch
):
    host, password = locked_registry
    docker_config = tmp_path / "docker"
    docker_config.mkdir()
    auth = base64.b64encode(f"{USER}:{password}".encode()).decode()
    (docker_config / "config.json").write_text(json.dumps({"auths": {host: {"auth": auth}}}))
    monkeypatch.setenv("DOCKER_CONFIG", str(docker_config))
    image = tiny_image(tmp_path)
    registry = Registry(host)
    assert push_image(registry, "sparkforge/tiny", image, ["v1"]) == image.digest
    assert Registry(host).manifest_digest("sparkforge/tiny", "v1") == image.digest
    assert password not in repr(registry)

    (docker_config / "config.json").write_text(
        json.dumps({"auths": {host: {"auth": base64.b64encode(f"{USER}:wrong".encode()).decode()}}})
    )
    with pytest.raises(ImageError) as err:
        Registry(host).manifest_digest("sparkforge/tiny", "v1")
    assert "HTTP 401" in str(err.value) and "wrong" not in str(err.value)


def test_a_credential_helper_wins_over_auths_for_the_same_host(
    locked_registry, tmp_path, monkeypatch
):
    host, password = locked_registry
    helpers = tmp_path / "bin"
    helpers.mkdir()
    asked = tmp_path / "asked"
    helper = helpers / "docker-credential-sparkforge-test"
    answer = json.dumps({"Username": USER, "Secret": password})
    helper.write_text(f"#!/bin/sh\n[ \"$1\" = get ] || exit 1\ncat > '{asked}'\necho '{answer}'\n")
    helper.chmod(0o755)
    monkeypatch.setenv("PATH", f"{helpers}:{os.environ['PATH']}")
    docker_config = tmp_path / "docker"
    docker_config.mkdir()
    wrong = base64.b64encode(f"{USER}:wrong".encode()).decode()
    (docker_config / "config.json").write_text(
        json.dumps({"auths": {host: {"auth": wrong}}, "credHelpers": {host: "sparkforge-test"}})
    )
    monkeypatch.setenv("DOCKER_CONFIG", str(docker_config))
    image = tiny_image(tmp_path)
    assert push_image(Registry(host), "sparkforge/tiny", image, ["v1"]) == image.digest
    assert asked.read_text() == host  # the helper was asked, for this registry
    assert Registry(host).manifest_digest("sparkforge/tiny", "v1") == image.digest

    # Without the helper entry, the same config's auths (a wrong password) is what Docker uses.
    (docker_config / "config.json").write_text(json.dumps({"auths": {host: {"auth": wrong}}}))
    with pytest.raises(ImageError, match="HTTP 401"):
        Registry(host).manifest_digest("sparkforge/tiny", "v1")
