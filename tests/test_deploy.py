"""`doit deploy` on the local stack, as a user runs it: the simulated runtime in containers of
the stack's engine, `:stable` in the stack's registry (under a namespace of the tests' own)."""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import requests
import yaml
from conftest import delete_repository

from pipelines.images.registry import ACCEPT
from pipelines.paths import PROFILES_DIR

REPO = Path(__file__).resolve().parent.parent
NAME = f"deploytest{uuid.uuid4().hex[:6]}"


def free_port() -> int:
    """A port nothing listens on now (the simulator binds it a few seconds later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def world(stack, tmp_path_factory, docker_client):
    """A profile of its own (the local one, renamed, on a free port), a store and a registry
    namespace of its own; its containers and tags are removed at the end."""
    root = tmp_path_factory.mktemp("deploy")
    profiles = root / "profiles"
    profiles.mkdir()
    profile = yaml.safe_load((PROFILES_DIR / "local.yaml").read_text())
    profile["name"] = NAME
    profile["simulator"]["port"] = free_port()
    (profiles / f"{NAME}.yaml").write_text(yaml.safe_dump(profile))
    namespace = f"sparkforge-test-{uuid.uuid4().hex[:8]}"
    env = {
        **os.environ,
        "SPARKFORGE_STORE": str(root / "store"),
        "SPARKFORGE_PROFILES": str(profiles),
        "SPARKFORGE_REGISTRY_NAMESPACE": namespace,
        "SPARKFORGE_DEPLOY_TIMEOUT": "15",
    }
    world = {
        "env": env,
        "profiles": profiles,
        "profile": profile,
        "store": root / "store",
        "url": f"http://127.0.0.1:{profile['simulator']['port']}",
        "repository": f"{namespace}/sparkforge/local-sim",
        "registry": stack.registry,
    }
    yield world
    for container in docker_client.containers.list(all=True, filters={"name": NAME}):
        container.remove(force=True)
    delete_repository(stack.registry, world["repository"])


def doit(world, *args: str) -> subprocess.CompletedProcess:
    """Run doit in the checkout on the test's profile, store and namespace."""
    return subprocess.run(
        [sys.executable, "-m", "doit", *args, f"profile={NAME}"],
        cwd=REPO,
        env=world["env"],
        capture_output=True,
        text=True,
        timeout=600,
    )


def tag_digest(world, tag: str) -> str | None:
    """The digest a tag of the test's repository points to, if any."""
    r = requests.head(
        f"http://{world['registry']}/v2/{world['repository']}/manifests/{tag}",
        headers={"Accept": ACCEPT},
        timeout=10,
    )
    return r.headers["Docker-Content-Digest"] if r.status_code == 200 else None


def served_models(world) -> list[str]:
    """The model names the deployed service lists."""
    answer = requests.get(f"{world['url']}/v1/models", timeout=5).json()
    return [card["id"] for card in answer["data"]]


def member(docker_client):
    """The one member's container."""
    return docker_client.containers.get(f"sparkforge-{NAME}-0")


def records(world) -> list[dict]:
    """The deployment records, oldest first."""
    folder = world["store"] / "deployments" / NAME
    return [
        json.loads(p.read_text()) for p in sorted(folder.glob("*.json"), key=lambda p: int(p.stem))
    ]


def derived_image(world, docker_client, tag: str, cmd: list[str] | None = None) -> str:
    """An image made from the deployed one (another CMD, a label), pushed; returns its digest."""
    base = member(docker_client).attrs["Config"]["Image"]
    lines = [f"FROM {base}", f"LABEL dev.sparkforge.test={tag}"]
    if cmd:
        lines.append(f"CMD {json.dumps(cmd)}")
    ref = f"{world['registry']}/{world['repository']}"
    docker_client.images.build(fileobj=io.BytesIO("\n".join(lines).encode()), tag=f"{ref}:{tag}")
    docker_client.images.push(ref, tag=tag)
    return tag_digest(world, tag)


def deployed(world):
    """The latest deploy, made sure to have served."""
    result = doit(world, "deploy")
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def test_deploy_serves_the_model_moves_stable_and_a_second_deploy_restarts_nothing(
    world, docker_client
):
    first = deployed(world)
    assert f"the service answers at {world['url']}/v1" in first.stdout
    assert served_models(world) == [world["profile"]["model"]["served_name"]]
    container = member(docker_client)
    digest = container.attrs["Config"]["Image"].rsplit("@", 1)[1]
    assert tag_digest(world, "stable") == digest
    mount = container.attrs["Mounts"][0]
    assert (mount["Destination"], mount["RW"]) == ("/models", False)

    second = deployed(world)
    assert "deploy: nothing restarted" in second.stdout
    again = member(docker_client)
    assert (again.id, again.attrs["State"]["StartedAt"]) == (
        container.id,
        container.attrs["State"]["StartedAt"],
    )
    assert [r["outcome"] for r in records(world)][-2:] in (
        ["deployed", "unchanged"],
        ["unchanged", "unchanged"],
    )
    status = doit(world, "status")
    assert "doit build now: matches" in status.stdout
    assert f"member localhost: sparkforge-{NAME}-0 running on unix://" in status.stdout


def test_a_broken_image_is_rolled_back_and_stable_does_not_move(world, docker_client):
    deployed(world)
    good = member(docker_client)
    stable = tag_digest(world, "stable")
    broken = derived_image(
        world, docker_client, "broken", ["python3", "-c", "import time; time.sleep(3600)"]
    )

    result = doit(world, "deploy", f"image_digest={broken}")

    assert result.returncode != 0
    out = result.stdout + result.stderr
    assert f"{world['url']}: not serving after 15 s" in out
    assert "the previous deployment was restored" in out
    assert "Traceback" not in out
    back = member(docker_client)
    assert back.id == good.id and back.status == "running"
    assert served_models(world) == [world["profile"]["model"]["served_name"]]
    assert tag_digest(world, "stable") == stable
    assert records(world)[-1]["outcome"] == "rolled back"
    assert broken in records(world)[-1]["image"]


def test_rollback_restores_the_previous_deployment_and_stable_prev(world, docker_client):
    deployed(world)
    first = tag_digest(world, "stable")
    variant = derived_image(world, docker_client, "variant")
    moved = doit(world, "deploy", f"image_digest={variant}")
    assert moved.returncode == 0, moved.stdout + moved.stderr
    assert (tag_digest(world, "stable"), tag_digest(world, "stable-prev")) == (variant, first)

    result = doit(world, "rollback")

    assert result.returncode == 0, result.stdout + result.stderr
    assert tag_digest(world, "stable") == first
    assert member(docker_client).attrs["Config"]["Image"].endswith(first)
    assert served_models(world) == [world["profile"]["model"]["served_name"]]
    assert records(world)[-1]["outcome"] == "restored"


def test_an_unreachable_engine_stops_the_deploy_before_anything_is_touched(world, docker_client):
    deployed(world)
    before = member(docker_client)
    profile = {**world["profile"]}
    profile["members"] = [{**profile["members"][0], "docker": "unix:///nonexistent/docker.sock"}]
    (world["profiles"] / f"{NAME}.yaml").write_text(yaml.safe_dump(profile))
    try:
        result = doit(world, "deploy")
    finally:
        (world["profiles"] / f"{NAME}.yaml").write_text(yaml.safe_dump(world["profile"]))

    assert result.returncode != 0
    assert (
        "member localhost: Docker engine unix:///nonexistent/docker.sock unreachable"
        " (DockerException); expected a running engine at that URL"
    ) in result.stdout + result.stderr
    assert member(docker_client).id == before.id
    assert records(world)[-1]["outcome"] == "refused"
