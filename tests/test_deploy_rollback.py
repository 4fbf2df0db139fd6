"""A deploy that fails, is rolled back by hand, or is stopped by a signal leaves the previous
deployment serving and `:stable` where it was (one member on the local stack)."""

from __future__ import annotations

import copy
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.deploying import (
    deploy_variant,
    deployed,
    derived_image,
    doit,
    member,
    records,
    served_models,
    tag_digest,
)
from support.signals import default_signals

REPO = Path(__file__).resolve().parent.parent


def test_a_broken_image_is_rolled_back_and_stable_does_not_move(world, docker_client):
    deployed(world)
    good = member(docker_client, world["name"])
    stable = tag_digest(world, "stable")
    broken = derived_image(
        world, docker_client, "broken", ["python3", "-c", "import time; time.sleep(3600)"]
    )

    result = doit(world, "deploy", f"image_digest={broken}")

    assert result.returncode != 0
    out = result.stdout + result.stderr
    assert "member localhost on unix://" in out
    assert f"{world['url']}: not serving after 15 s" in out
    assert "the previous deployment was restored" in out
    assert "Traceback" not in out
    back = member(docker_client, world["name"])
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
    assert (tag_digest(world, "stable"), tag_digest(world, "stable-prev")) == (first, variant)
    assert member(docker_client, world["name"]).attrs["Config"]["Image"].endswith(first)
    assert served_models(world) == [world["profile"]["model"]["served_name"]]
    assert records(world)[-1]["outcome"] == "restored"


def test_rollback_of_an_env_change_points_stable_at_the_restored_image(world, docker_client):
    # stable-prev names an older image: promote moves it only when :stable changes digest, and
    # the env change below does not, so moving :stable "back" to it would name the wrong image.
    deployed(world)
    older = derived_image(world, docker_client, "older")
    moved = doit(world, "deploy", f"image_digest={older}")
    assert moved.returncode == 0, moved.stdout + moved.stderr
    deployed(world)
    first = tag_digest(world, "stable")
    assert tag_digest(world, "stable-prev") == older
    changed = copy.deepcopy(world["profile"])
    changed["env"] = {"SIM_NOTE": "two"}
    second = deploy_variant(world, changed)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "SIM_NOTE=two" in member(docker_client, world["name"]).attrs["Config"]["Env"]

    result = doit(world, "rollback")

    print(result.stdout + result.stderr)
    assert result.returncode == 0, result.stdout + result.stderr
    assert tag_digest(world, "stable") == first
    serving = member(docker_client, world["name"]).attrs["Config"]
    assert serving["Image"].endswith(first)
    assert "SIM_NOTE=two" not in serving["Env"]
    assert served_models(world) == [world["profile"]["model"]["served_name"]]
    assert records(world)[-1]["outcome"] == "restored"
    [said] = [line for line in result.stdout.splitlines() if line.startswith("rollback: ")]
    assert f":stable already at {first}" in said, said


@pytest.mark.parametrize(
    ("sent", "reason"),
    [
        (signal.SIGINT, "KeyboardInterrupt"),
        (signal.SIGTERM, "Terminated"),
        (signal.SIGHUP, "Terminated"),
    ],
    ids=["ctrl-c", "sigterm", "sighup"],
)
def test_ctrl_c_or_a_stop_signal_during_a_deploy_restores_the_previous_one(
    world, docker_client, sent, reason
):
    """Ctrl-C at a terminal; SIGTERM or SIGHUP as a cancelled CI job or a timeout sends."""
    deployed(world)
    good = member(docker_client, world["name"])
    broken = derived_image(
        world, docker_client, "stuck", ["python3", "-c", "import time; time.sleep(3600)"]
    )
    deploy = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "doit",
            "deploy",
            f"profile={world['name']}",
            f"image_digest={broken}",
        ],
        cwd=REPO,
        env={**world["env"], "SPARKFORGE_DEPLOY_TIMEOUT": "300", "PYTHONFAULTHANDLER": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=default_signals,  # as at a terminal, whatever started the suite
    )
    # Interrupt once the new container runs: the deploy is then waiting for it to serve.
    deadline = time.monotonic() + 300
    while deploy.poll() is None and time.monotonic() < deadline:
        containers = docker_client.containers.list(
            filters={"name": f"sparkforge-{world['name']}-0$"}
        )
        if containers and containers[0].attrs["Config"]["Image"].endswith(broken):
            break
        time.sleep(0.2)
    deploy.send_signal(sent)
    try:
        out, _ = deploy.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        # Where it hangs (faulthandler prints every thread on SIGABRT), and no deploy left
        # running to race the next test.
        deploy.send_signal(signal.SIGABRT)
        out, _ = deploy.communicate(timeout=60)
        pytest.fail(f"deploy still running 120 s after {sent.name}:\n{out}")

    assert deploy.returncode != 0, out
    back = member(docker_client, world["name"])
    assert back.id == good.id and back.status == "running"
    assert served_models(world) == [world["profile"]["model"]["served_name"]]
    last = records(world)[-1]
    assert (last["outcome"], last["reason"]) == ("rolled back", reason)
