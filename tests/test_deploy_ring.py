"""A ring of two members on the local stack: one on its engine, one on its second engine over
ssh://; deployed together, rolled back together, refused together."""

from __future__ import annotations

import socket
import subprocess

import docker
import pytest
from support.deploying import (
    deploy_variant,
    deployed,
    doit,
    member,
    records,
    ring_containers,
    serves_on,
)
from support.ports import spare_ports


def test_a_ring_deploys_one_member_per_engine_one_over_ssh_and_redeploys_nothing(
    ring, stack, docker_client
):
    result = deployed(ring)
    assert stack.docker_hosts[1].startswith("ssh://")
    port = ring["profile"]["simulator"]["port"]
    served = ring["profile"]["model"]["served_name"]
    assert serves_on(port) == [served] and serves_on(port + 1) == [served]
    containers = ring_containers(ring, stack, docker_client)
    with pytest.raises(docker.errors.NotFound):
        member(docker_client, ring["name"], 1)  # rank 1 lives on the second engine only
    assert "member ring-b:" not in result.stdout  # no problem line (the diff names it)

    again = deployed(ring)
    assert "deploy: nothing restarted" in again.stdout
    assert [c.id for c in ring_containers(ring, stack, docker_client)] == [c.id for c in containers]


def test_a_member_failing_on_one_host_rolls_back_every_member(ring, stack, docker_client):
    deployed(ring)
    before = ring_containers(ring, stack, docker_client)
    old_port = ring["profile"]["simulator"]["port"]
    changed = {**ring["profile"], "simulator": {**ring["profile"]["simulator"]}}
    new_port = spare_ports(2)
    changed["simulator"]["port"] = new_port
    # Member 1's host has its new port taken: its server cannot start there.
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", new_port + 1))
        taken.listen()
        result = deploy_variant(ring, changed)

    assert result.returncode != 0
    out = result.stdout + result.stderr
    assert "member ring-b on ssh://" in out and "exited (1)" in out
    assert "the previous deployment was restored" in out
    after = ring_containers(ring, stack, docker_client)
    assert [c.id for c in after] == [c.id for c in before]
    assert [c.status for c in after] == ["running", "running"]
    served = ring["profile"]["model"]["served_name"]
    assert serves_on(old_port) == [served] and serves_on(old_port + 1) == [served]
    assert records(ring)[-1]["outcome"] == "rolled back"


def test_a_refused_ssh_key_stops_the_ring_deploy_before_anything_is_touched(
    ring, stack, docker_client, tmp_path
):
    deployed(ring)
    before = [c.id for c in ring_containers(ring, stack, docker_client)]
    stranger = tmp_path / "stranger"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", stranger], check=True)

    result = doit(ring, "deploy", SPARKFORGE_SSH_IDENTITY=str(stranger))

    assert result.returncode != 0
    out = result.stdout + result.stderr
    assert f"member ring-b: {stack.docker_hosts[1]}: ssh: " in out
    assert "Permission denied (publickey)" in out
    assert "Traceback" not in out
    assert [c.id for c in ring_containers(ring, stack, docker_client)] == before
    assert records(ring)[-1]["outcome"] == "refused"
