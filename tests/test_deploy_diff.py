"""`doit diff`, pruning and drift on Docker hosts, as a user runs them: the local stack's real
engines (`local`, and `local-ring` with its second member over ssh://)."""

from __future__ import annotations

import copy

import docker
import pytest
import requests
import yaml
from support.deploying import (
    deployed,
    derived_image,
    doit,
    member,
    records,
    ring_containers,
    second_engine,
    serves_on,
)


def with_profile(world, profile: dict, *args: str):
    """`doit ARGS` with the test's profile replaced by profile for this one run."""
    path = world["profiles"] / f"{world['name']}.yaml"
    path.write_text(yaml.safe_dump(profile))
    try:
        return doit(world, *args)
    finally:
        path.write_text(yaml.safe_dump(world["profile"]))


def test_diff_of_a_changed_env_names_the_field_exits_6_and_touches_nothing(world, docker_client):
    deployed(world)
    same = doit(world, "diff")
    assert same.returncode == 0, same.stdout + same.stderr
    assert "would change: nothing" in same.stdout
    before = member(docker_client, world["name"])
    changed = copy.deepcopy(world["profile"])
    changed["env"] = {"SIM_NOTE": "two"}

    result = with_profile(world, changed, "diff")

    print(result.stdout + result.stderr)  # as the user sees it (`pytest -rP` shows it)
    assert result.returncode == 6, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    name = f"sparkforge-{world['name']}-0"
    assert any(
        line.startswith(f"  member localhost ({name} on unix://") and line.endswith(": replace")
        for line in lines
    ), result.stdout
    assert '      env.SIM_NOTE: (absent) -> "two"' in lines
    said = result.stdout + result.stderr
    assert f"diff {world['name']}: 1 member(s)/object(s) would change;" in said
    assert "Traceback" not in result.stdout + result.stderr
    after = member(docker_client, world["name"])
    assert (after.id, after.status) == (before.id, "running")


def test_status_names_a_container_restarted_with_another_image_and_exits_7(world, docker_client):
    deployed(world)
    clean = doit(world, "status")
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert "  drift since deployed: nothing" in clean.stdout
    derived_image(world, docker_client, "by-hand")
    other = f"{world['registry']}/{world['repository']}:by-hand"
    old = member(docker_client, world["name"])
    image, attrs = old.attrs["Config"]["Image"], old.attrs
    # What a person does by hand: the same container, name, labels and mounts, another image.
    old.remove(force=True)
    binds = [f"{m['Source']}:{m['Destination']}:ro" for m in attrs["Mounts"]]
    docker_client.containers.run(
        other,
        name=attrs["Name"].lstrip("/"),
        detach=True,
        environment=attrs["Config"]["Env"],
        labels=attrs["Config"]["Labels"],
        network_mode="host",
        volumes=binds,
    )
    try:
        result = doit(world, "status")
    finally:
        member(docker_client, world["name"]).remove(force=True)  # the next deploy makes it anew

    print(result.stdout + result.stderr)
    assert result.returncode == 7, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert any(
        line.startswith("    member localhost (") and line.endswith(": changed since deployed")
        for line in lines
    ), result.stdout
    assert f'        image: "{image}" -> "{other}"' in lines
    assert "env." not in result.stdout  # the same env: only the image is named
    said = result.stdout + result.stderr
    assert "changed since deployment" in said and "(drift)" in said


def test_a_ring_with_a_member_removed_prunes_exactly_its_container_and_rollback_restores_it(
    ring, stack, docker_client
):
    deployed(ring)
    _, dropped = ring_containers(ring, stack, docker_client)
    smaller = copy.deepcopy(ring["profile"])
    smaller["members"] = smaller["members"][:1]
    smaller["parallel"]["tensor"] = 1
    where = f"container {dropped.name} on {stack.docker_hosts[1]}"

    plan = with_profile(ring, smaller, "diff")
    assert plan.returncode == 6, plan.stdout + plan.stderr
    assert f"  {where}: delete (prune)" in plan.stdout.splitlines()
    kept_plan = with_profile(ring, smaller, "diff", "prune=no")
    assert f"  {where}: keep (prune=no)" in kept_plan.stdout.splitlines()

    result = with_profile(ring, smaller, "deploy")
    print(plan.stdout + plan.stderr, result.stdout, records(ring)[-1]["pruned"])

    assert result.returncode == 0, result.stdout + result.stderr
    assert f"deploy: pruned {where}" in result.stdout
    second = docker.DockerClient(base_url=second_engine(stack))
    assert not second.containers.list(all=True, filters={"name": dropped.name})
    assert member(docker_client, ring["name"], 0).status == "running"
    [entry] = records(ring)[-1]["pruned"]
    assert entry["engine"] == stack.docker_hosts[1] and entry["container"] == dropped.name

    back = doit(ring, "rollback")

    # Both deployments ran one image: :stable stays where it is, and rollback says so.
    assert back.returncode == 0, back.stdout + back.stderr
    assert "the restored deployment's image" in back.stdout
    assert member(second, ring["name"], 1).status == "running"
    port = ring["profile"]["simulator"]["port"]
    served = ring["profile"]["model"]["served_name"]
    assert serves_on(port) == [served] and serves_on(port + 1) == [served]
    assert records(ring)[-1]["outcome"] == "restored"


def test_one_ring_member_moved_to_another_address_is_the_diff_and_the_only_restart(
    ring, stack, docker_client
):
    deployed(ring)
    before = ring_containers(ring, stack, docker_client)
    moved = copy.deepcopy(ring["profile"])
    # Any 127.0.0.0/8 address is this machine's: member 1 really listens elsewhere.
    moved["members"][1]["address"] = "127.0.0.2"
    port = moved["simulator"]["port"] + 1

    plan = with_profile(ring, moved, "diff")

    print(plan.stdout + plan.stderr)  # the diff as the user sees it (`pytest -rP` shows it)
    assert plan.returncode == 6, plan.stdout + plan.stderr
    lines = plan.stdout.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("diff: "))
    assert lines[head].endswith("would change: 1 member(s)/object(s), 3 field(s)")
    listed = lines[head + 1 : head + 5]
    name = f"sparkforge-{ring['name']}-1"
    assert listed[0] == f"  member ring-b ({name} on {stack.docker_hosts[1]}): replace"
    assert listed[1:3] == [
        '      address: "127.0.0.1" -> "127.0.0.2"',
        '      env.SIM_HOST: "127.0.0.1" -> "127.0.0.2"',
    ]
    # The member's key (its plan's), hence the restart: the last line, and nothing for ring-a.
    assert listed[3].startswith("      labels[dev.sparkforge.member]: ")

    result = with_profile(ring, moved, "deploy")

    print(result.stdout)
    assert result.returncode == 0, result.stdout + result.stderr
    after = ring_containers(ring, stack, docker_client)
    assert after[0].id == before[0].id and after[1].id != before[1].id
    served = ring["profile"]["model"]["served_name"]
    answer = requests.get(f"http://127.0.0.2:{port}/v1/models", timeout=5).json()
    assert [card["id"] for card in answer["data"]] == [served]
    with pytest.raises(requests.ConnectionError):
        requests.get(f"http://127.0.0.1:{port}/v1/models", timeout=5)
    again = with_profile(ring, moved, "diff")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "would change: nothing" in again.stdout
    # Ring-a, left running under the previous deployment's key, has not drifted.
    status = with_profile(ring, moved, "status")
    assert status.returncode == 0, status.stdout + status.stderr


def test_a_prune_argument_other_than_yes_or_no_is_one_line_and_exit_2(world):
    result = doit(world, "diff", "prune=maybe")
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.strip().splitlines() == [
        "error: doit argument prune='maybe': expected prune=yes or prune=no"
    ]


def test_a_kept_launch_plan_of_the_wrong_shape_is_named_field_by_field():
    from pipelines.stages.deploy.docker import kept_plan_problems
    from pipelines.stages.deploy.plan import Deployment

    good = {"rank": 0, "node": "a", "image": "r/i@sha256:" + "0" * 64, "address": "127.0.0.1"}
    good |= {"port": 8000, "env": {"A": "1"}, "mounts": [{"source": "/m", "target": "/models"}]}
    bad = {**good, "rank": "0", "env": {"A": 1}, "mounts": [{"source": "/m"}], "restarts": 1}
    del bad["image"]
    kept = Deployment("local", "k" * 64, (good, bad, "plan"), "r/i", ("unix:///a", "unix:///b"))
    assert kept_plan_problems(kept) == [
        "deployment.engines: 2 for 3 launch plans; expected one per plan",
        "deployment.documents[1].rank: expected int, found str",
        "deployment.documents[1].image: expected str, found nothing",
        "deployment.documents[1].mounts[0]: expected an object with source and target strings",
        "deployment.documents[1].env: expected string values",
        'deployment.documents[1].restarts: expected "alone" or no such field, found 1',
        "deployment.documents[2]: expected a launch plan (an object)",
    ]
