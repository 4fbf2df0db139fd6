"""`doit stage_ring` on the local stack: each member's weights from S3 once and from its peer,
then deployed from its own folder."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
from pathlib import Path

import docker
import pytest
import yaml
from support.deploying import (
    deployed,
    doit,
    make_world,
    member,
    second_engine,
    seed_image,
)
from support.doit import run_doit
from support.ports import spare_ports
from support.registry_repos import delete_repository

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def staging_ring(space, stack, tmp_path_factory):
    """The ring with a weights folder per member and its own link address on loopback
    (127.0.0.2 and 127.0.0.3), as two hosts would have: each member's blob server and folder
    are its own although both engines run on this machine; its weights-stager in the module's
    namespace under its key (the session's one build, copied), as a lab pushes it once."""
    stager = space["repository"].rsplit("/", 1)[0] + "/weights-stager"
    seed_image(stack, stager, space["store"], tmp_path_factory, image="weights-stager")
    world = make_world(space, stack, "local-ring", f"{space['prefix']}stage")
    roots = [tmp_path_factory.mktemp(f"member{rank}") for rank in range(2)]
    profile = world["profile"]
    profile["members"][0].update(weights_root=str(roots[0]), links={"ring-b": "127.0.0.2"})
    profile["members"][1].update(weights_root=str(roots[1]), links={"ring-a": "127.0.0.3"})
    profile["staging"] = {"port": spare_ports(), "peer_wait_s": 120}
    (space["profiles"] / f"{world['name']}.yaml").write_text(yaml.safe_dump(profile))
    lock = yaml.safe_load((REPO / "weights" / f"{profile['model']['lock']}.lock.yaml").read_text())
    yield {**world, "roots": roots, "lock": lock}
    delete_repository(stack.registry, stager)


DONE = re.compile(
    r"stage_ring (ring-[ab]): done: (\d+) files verified, ([\d.]+) MiB from S3, ([\d.]+) MiB from"
    r" peers"
)


def done_members(out: str) -> dict[str, tuple[int, float, float]]:
    """Per member of stage_ring's output: files verified, MiB from S3, MiB from peers."""
    return {m[0]: (int(m[1]), float(m[2]), float(m[3])) for m in DONE.findall(out)}


def stage_with_second_root(staging_ring, root: Path) -> subprocess.CompletedProcess:
    """stage_ring with ring-b's weights at root for this run only."""
    profile = yaml.safe_load(yaml.safe_dump(staging_ring["profile"]))
    profile["members"][1]["weights_root"] = str(root)
    path = staging_ring["profiles"] / f"{staging_ring['name']}.yaml"
    path.write_text(yaml.safe_dump(profile))
    try:
        return doit(staging_ring, "stage_ring")
    finally:
        path.write_text(yaml.safe_dump(staging_ring["profile"]))


def stager_containers(stack, docker_client, prefix: str) -> list:
    """Staging containers of the module's profiles left on either engine."""
    second = docker.DockerClient(base_url=second_engine(stack))
    return [
        c
        for client in (docker_client, second)
        for c in client.containers.list(all=True, filters={"name": "-stage-"})
        if prefix in c.name
    ]


def test_stage_ring_takes_each_file_from_s3_once_and_the_rest_from_the_peer_then_deploys(
    staging_ring, stack, docker_client
):
    result = doit(staging_ring, "stage_ring")
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    done = done_members(out)
    files = staging_ring["lock"]["files"]
    total_mib = sum(f["size"] for f in files) / (1 << 20)
    assert set(done) == {"ring-a", "ring-b"}
    assert all(n == len(files) for n, _, _ in done.values())
    # One model from S3 between the two (each prints to 0.1 MiB), the rest over the link.
    assert abs(sum(s3 for _, s3, _ in done.values()) - total_mib) < 0.2
    assert all(peers > 0.2 * total_mib for _, _, peers in done.values())
    assert "stage_ring ring-b: serving on 127.0.0.3:" in out  # on its own link address
    assert stager_containers(stack, docker_client, staging_ring["prefix"]) == []

    lock_sha = hashlib.sha256(
        (REPO / "weights" / f"{staging_ring['profile']['model']['lock']}.lock.yaml").read_bytes()
    ).hexdigest()
    key = hashlib.sha256(staging_ring["profile"]["model"]["source"].encode()).hexdigest()[:16]
    for root in staging_ring["roots"]:
        folder = root / "models" / key
        for f in files:
            data = (folder / f["name"]).read_bytes()
            assert hashlib.sha256(data).hexdigest() == f["sha256"], (root, f["name"])
            blob = root / "blobs" / "sha256" / f["sha256"]
            assert (folder / f["name"]).stat().st_ino == blob.stat().st_ino  # a hard link
        staged = json.loads((folder.parent / f"{key}.staged.json").read_text())
        assert staged == {"lock_sha256": lock_sha}

    # Deploy finds each member's own folder staged (preflight) and mounts it.
    deployed(staging_ring)
    second = docker.DockerClient(base_url=second_engine(stack))
    for rank, client in enumerate((docker_client, second)):
        mounts = member(client, staging_ring["name"], rank).attrs["Mounts"]
        assert [m["Source"] for m in mounts] == [str(staging_ring["roots"][rank] / "models" / key)]


def test_stage_ring_again_fetches_nothing(staging_ring):
    result = doit(staging_ring, "stage_ring")
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    done = done_members(out)
    assert set(done) == {"ring-a", "ring-b"}
    assert all(s3 == 0 and peers == 0 for _, s3, peers in done.values()), done


def test_a_member_that_cannot_stage_is_named_with_its_log_and_no_container_is_left(
    staging_ring, stack, stack_env, docker_client, tmp_path
):
    not_a_folder = tmp_path / "not-a-folder"
    not_a_folder.write_text("a file where ring-b's weights folder should be\n")
    result = stage_with_second_root(staging_ring, not_a_folder)
    out = result.stdout + result.stderr
    assert result.returncode != 0
    failed = [line for line in out.splitlines() if "member ring-b: staging exited" in line]
    assert len(failed) == 1 and "not-a-folder" in failed[0], out
    assert "member ring-a: staging exited" not in out  # ring-a is stopped, not failed
    assert stack_env["AWS_SECRET_ACCESS_KEY"] not in out
    assert stager_containers(stack, docker_client, staging_ring["prefix"]) == []


def test_a_fresh_nodes_missing_weights_folder_is_made(staging_ring, tmp_path):
    fresh = tmp_path / "fresh" / "weights"
    result = stage_with_second_root(staging_ring, fresh)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    done = done_members(out)
    files = staging_ring["lock"]["files"]
    total_mib = sum(f["size"] for f in files) / (1 << 20)
    # ring-a has everything already; the fresh ring-b takes its own share from S3, as planned,
    # and the rest from ring-a.
    assert done["ring-a"][1:] == (0.0, 0.0), done
    assert abs(done["ring-b"][1] + done["ring-b"][2] - total_mib) < 0.2 and done["ring-b"][2] > 0
    assert len(list((fresh / "blobs" / "sha256").iterdir())) == len(files)


def test_stage_ring_builds_its_stager_first_where_no_lab_pushed_one():
    # The module above finds the stager its seed pushed, as a lab's ring does; where none was
    # pushed, stage_ring's own graph builds it before staging (the image step finds or builds it
    # by key, tests/test_images.py).
    # (`doit info` exits 1 for a task that would run: its listing is what counts.)
    info = run_doit("info", "stage_ring", "profile=local-ring")
    assert "task_dep" in info.stdout, info.stdout + info.stderr
    listed = info.stdout.split("task_dep", 1)[1].split("\n\n", 1)[0]
    assert "stager_image" in re.findall(r"^ - (\S+)$", listed, re.MULTILINE), info.stdout
