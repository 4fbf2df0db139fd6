"""The fabric check's pruning on Kubernetes, against the API double (tests/kube_api.py): what an
earlier render's check applied and this one lacks goes after the next check, and the deploy's
prune and the fabric's never take each other's objects."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import kube_api
import pytest
import test_deploy_kubernetes as kube
import yaml
from support import stages
from test_deploy_diff_kubernetes import MEMBER_3, without_member_3
from test_deploy_kubernetes import IMAGE_A, SECRET, World, deploy, deploy_stage

from pipelines.core.profiles import load_profile
from pipelines.engine.steps import Engine
from pipelines.engine.store import Store
from pipelines.stages.fabric import Fabric
from pipelines.stages.fabric.launch import KubernetesLauncher
from pipelines.targets.kubeapi import KubeAccess
from pipelines.targets.pruning import PruneSettingError

# The Kubernetes deploy tests' world: the double, its kubeconfig, the module's render store.
renders = kube.renders
world = kube.world

REPO = Path(__file__).resolve().parent.parent
P2P_LOG = (REPO / "tests" / "data" / "nccl" / "torch-p2p.log").read_text()
OWNER = "sparkforge.dev/profile"  # written out: the labels a cluster shows, not the code's names
PART = "sparkforge.dev/part"
FABRIC_LABELS = {OWNER: "tp3-ring", PART: "fabric"}
# What the check of an earlier render left: its probe ConfigMap under the service's old name,
# and the Job of a fourth member from a killed run of a four-member ring.
EARLIER = [
    ("v1", "ConfigMap", "dsv41-old-fabric-probe"),
    ("batch/v1", "Job", "dsv41-flash-fabric-3"),
]


def put(world: World, api_version: str, kind: str, name: str, labels: dict[str, str]) -> str:
    """An object in the profile's namespace, as something else applied it; its kind/name."""
    meta = {"name": name, "namespace": "dsv41", "labels": labels}
    world.double.add({"apiVersion": api_version, "kind": kind, "metadata": meta})
    return f"{kind}/{name}"


def fabric_stage(world: World, **variables: str) -> Fabric:
    """tp3-ring's fabric stage as dodo wires it (the deploy's render), its Jobs on the double."""
    profile = load_profile("tp3-ring")
    engine = Engine(Store(world.store), root=REPO)
    render = stages.render_stage(profile, engine, IMAGE_A, [SECRET])
    engine.run(render.step)
    context = stages.context(profile, engine, expect="P2P>=200", **variables)
    stage = Fabric(context, render=render.step, live=lambda: None)
    access = KubeAccess(str(world.kubeconfig), poll_s=0.001)
    for rank in range(3):
        world.double.logs[f"dsv41-flash-fabric-{rank}"] = P2P_LOG
    launcher = lambda p, s: KubernetesLauncher(p, access)  # noqa: E731
    stage.settings = dataclasses.replace(stage.settings, launcher=launcher, timeout_s=10)
    return stage


def names(world: World) -> set[str]:
    return {f"{kind}/{name}" for (_, kind, _, name) in world.double.objects}


def test_what_an_earlier_renders_check_left_is_pruned_by_the_next_and_named_in_its_result(
    world, capsys
):
    deploy(world, IMAGE_A)
    earlier = [put(world, *e, FABRIC_LABELS) for e in EARLIER]
    others = [
        put(world, "v1", "ConfigMap", "tp4-fabric-probe", {OWNER: "tp4-ring", PART: "fabric"}),
        put(world, "v1", "ConfigMap", "by-hand", {}),
        put(world, "batch/v1", "Job", "dsv41-bench", {OWNER: "tp3-ring", PART: "bench"}),
    ]
    before = names(world)
    capsys.readouterr()
    path = fabric_stage(world).check()
    out = capsys.readouterr().out
    # Only the two the earlier check left: the deployment's objects, another profile's, another
    # part's and an unlabelled one stay; the Jobs of this run were deleted after it, as before.
    assert before - names(world) == set(earlier)
    assert names(world) == before - set(earlier) | {"ConfigMap/dsv41-flash-fabric-probe"}
    assert set(others) <= names(world)
    assert "fabric: pruned ConfigMap/dsv41-old-fabric-probe in dsv41" in out
    assert "fabric: pruned Job/dsv41-flash-fabric-3 in dsv41" in out
    result = json.loads(path.read_text())
    assert result["outcome"] == "passed"
    assert sorted((e["kind"], e["name"], e["namespace"]) for e in result["pruned"]) == [
        ("ConfigMap", "dsv41-old-fabric-probe", "dsv41"),
        ("Job", "dsv41-flash-fabric-3", "dsv41"),
    ]
    # What the check applied carries the profile's ownership label and the fabric part's.
    probe = world.double.objects[("v1", "ConfigMap", "dsv41", "dsv41-flash-fabric-probe")]
    assert probe["metadata"]["labels"].items() >= FABRIC_LABELS.items()
    jobs = [
        yaml.safe_load(r.body)
        for r in world.double.requests
        if r.method == "PATCH" and "/jobs/dsv41-flash-fabric-" in r.path
    ]
    assert len(jobs) == 3
    assert all(job["metadata"]["labels"].items() >= FABRIC_LABELS.items() for job in jobs)


def test_prune_no_keeps_what_an_earlier_renders_check_left_and_says_so(world, capsys):
    earlier = [put(world, *e, FABRIC_LABELS) for e in EARLIER]
    capsys.readouterr()
    path = fabric_stage(world, prune="no").check()
    out = capsys.readouterr().out
    assert set(earlier) <= names(world)
    assert "fabric: kept (prune=no) Job/dsv41-flash-fabric-3 in dsv41" in out
    assert "fabric: pruned" not in out
    assert json.loads(path.read_text())["pruned"] == []


def test_the_prune_argument_of_the_fabric_check_takes_yes_or_no_only(world):
    with pytest.raises(PruneSettingError, match=r"prune='maybe': expected prune=yes or prune=no"):
        fabric_stage(world, prune="maybe")


def test_the_deploys_prune_leaves_the_fabric_checks_objects(world):
    deploy(world, IMAGE_A)
    fabric_stage(world).check()
    leftover = put(world, "batch/v1", "Job", "dsv41-flash-fabric-3", FABRIC_LABELS)
    fabric_objects = {"ConfigMap/dsv41-flash-fabric-probe", leftover}
    before = names(world)
    stage = without_member_3(deploy_stage(world, IMAGE_A))
    try:
        stage.deploy()
    finally:
        stage.backend.close()
    assert before - names(world) == set(MEMBER_3)
    assert fabric_objects <= names(world)
    pruned = stage.records.history()[-1]["pruned"]
    assert sorted(f"{e['kind']}/{e['name']}" for e in pruned) == sorted(MEMBER_3)


def test_a_server_that_ignores_the_label_selector_gets_nothing_else_pruned(world, monkeypatch):
    deploy(world, IMAGE_A)
    earlier = put(world, *EARLIER[1], FABRIC_LABELS)
    before = names(world)
    # An API server (or a proxy before it) that drops the ownership selector and answers with
    # the whole namespace (the pods' `job-name=` selector it still honours).
    whole = kube_api.list_objects

    def unselective(d, kind, namespace, selector):
        return whole(d, kind, namespace, "" if OWNER in selector else selector)

    monkeypatch.setattr(kube_api, "list_objects", unselective)
    path = fabric_stage(world).check()
    assert before - names(world) == {earlier}
    assert [e["name"] for e in json.loads(path.read_text())["pruned"]] == ["dsv41-flash-fabric-3"]
