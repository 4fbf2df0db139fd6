"""`doit diff`, pruning, drift in `doit status`, and a rollback's checks of its record, for the
Kubernetes backend against the API double (tests/kube_api.py)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import test_deploy_kubernetes as kube
from test_deploy_kubernetes import (
    IMAGE_A,
    IMAGE_B,
    configs_of,
    deploy,
    deploy_stage,
    outcomes,
    stored_configs,
)

from pipelines.core.errors import ChangesPending, Drift, Unreachable
from pipelines.stages.deploy.fielddiff import field_changes
from pipelines.stages.deploy.records import CorruptDeploymentRecord
from pipelines.targets.pruning import OWNER_LABEL, PruneSettingError, prune_wanted

# The Kubernetes deploy tests' world: the double, its kubeconfig, the module's render store.
renders = kube.renders
world = kube.world

# The objects render makes for member spark-3 (rank 2) beside the group's own.
MEMBER_3 = [
    "PersistentVolume/dsv41-cache-spark-3",
    "PersistentVolumeClaim/dsv41-cache-spark-3",
    "Job/dsv41-flash-tp3-patch-2",
    "Job/dsv41-flash-node-prep-2",
]


def named(doc: dict) -> str:
    return f"{doc['kind']}/{doc['metadata']['name']}"


def without_member_3(stage):
    """The stage, its candidate a render that dropped member spark-3's own objects."""
    full = stage.deployed.candidate()
    docs = tuple(d for d in full.documents if named(d) not in MEMBER_3)
    smaller = dataclasses.replace(full, key="d" * 64, documents=docs)
    stage.deployed.candidate = lambda: smaller
    return stage


def diff(stage):
    """`doit diff`'s action; the ChangesPending it raised, if any."""
    try:
        stage.deployed.diff()
    except ChangesPending as err:
        return err
    finally:
        stage.backend.close()
    return None


def test_diff_names_each_field_a_new_image_changes_and_writes_nothing(world, capsys):
    deploy(world, IMAGE_A)
    writes = len(world.double.writes())
    stage = deploy_stage(world, IMAGE_B)
    capsys.readouterr()
    pending = diff(stage)
    out = capsys.readouterr().out
    assert pending is not None and pending.exit_code == 6
    assert str(pending).startswith("diff tp3-ring: 7 member(s)/object(s) would change;")
    # The group as the dry run merged it; each Job against the rendered one (it is replaced).
    assert f'      spec.image: "{IMAGE_A}" -> "{IMAGE_B}"' in out.splitlines()
    assert "  InferenceService/dsv41-flash in dsv41: change" in out
    assert "  Job/dsv41-flash-tp3-patch-0 in dsv41: replace" in out
    assert (
        f'      spec.template.spec.containers[tp3-patch].image: "{IMAGE_A}" -> "{IMAGE_B}"'
        in out.splitlines()
    )
    assert "ConfigMap/sparkforge-tp3-patch" not in out  # unchanged objects are not listed
    new = world.double.writes()[writes:]
    assert new and all(r.query.get("dryRun") == "All" for r in new)


def test_diff_after_the_same_deploy_says_nothing_and_passes(world, capsys):
    deploy(world, IMAGE_A)
    capsys.readouterr()
    assert diff(deploy_stage(world, IMAGE_A)) is None
    assert "would change: nothing" in capsys.readouterr().out


def test_deploy_prints_the_diff_before_it_applies(world, capsys):
    deploy(world, IMAGE_A)
    capsys.readouterr()
    deploy(world, IMAGE_B)
    out = capsys.readouterr().out
    assert out.index(f'spec.image: "{IMAGE_A}" -> "{IMAGE_B}"') < out.index(
        "deploy: InferenceService/dsv41-flash in dsv41 configured"
    )


def test_a_render_that_drops_a_members_objects_prunes_exactly_those(world, capsys):
    deploy(world, IMAGE_A)
    d = world.double
    assert all(
        body["metadata"]["labels"][OWNER_LABEL] == "tp3-ring"
        for (_, kind, _, _), body in d.objects.items()
        if kind not in ("Namespace", "Node", "Secret")
    )
    before = set(d.objects)
    stage = without_member_3(deploy_stage(world, IMAGE_A))
    capsys.readouterr()
    try:
        stage.deploy()
    finally:
        stage.backend.close()
    out = capsys.readouterr().out
    gone = {f"{k[1]}/{k[3]}" for k in before - set(d.objects)}
    assert gone == set(MEMBER_3)
    assert set(d.objects) <= before  # nothing else deleted or made
    assert "  PersistentVolume/dsv41-cache-spark-3: delete (prune)" in out
    assert "deploy: pruned Job/dsv41-flash-node-prep-2 in dsv41" in out
    last = stage.records.history()[-1]
    assert last["outcome"] == "deployed"
    assert sorted(f"{e['kind']}/{e['name']}" for e in last["pruned"]) == sorted(MEMBER_3)
    pv = next(e for e in last["pruned"] if e["kind"] == "PersistentVolume")
    assert pv["namespace"] is None and pv["config"]["spec"]  # enough to make it again


def test_prune_no_keeps_what_the_render_dropped_and_diff_says_so(world, capsys):
    deploy(world, IMAGE_A)
    before = set(world.double.objects)
    stage = without_member_3(deploy_stage(world, IMAGE_A))
    stage.prune = stage.deployed.prune = prune_wanted("no")
    capsys.readouterr()
    assert diff(stage) is None  # keeping them is no change
    out = capsys.readouterr().out
    assert "  Job/dsv41-flash-tp3-patch-2 in dsv41: keep (prune=no)" in out
    stage = without_member_3(deploy_stage(world, IMAGE_A))
    stage.prune = stage.deployed.prune = False
    try:
        stage.deploy()
    finally:
        stage.backend.close()
    assert set(world.double.objects) == before
    assert stage.records.history()[-1]["pruned"] == []


def test_the_prune_argument_takes_yes_or_no_only():
    assert prune_wanted("") and prune_wanted("yes") and not prune_wanted("no")
    with pytest.raises(PruneSettingError) as err:
        prune_wanted("false")
    assert err.value.exit_code == 2
    assert str(err.value) == "doit argument prune='false': expected prune=yes or prune=no"


def test_a_rollback_restores_what_the_deploy_it_undoes_pruned(world):
    first = configs_of(deploy(world, IMAGE_A).deployed.candidate())
    stage = without_member_3(deploy_stage(world, IMAGE_A))
    try:
        stage.deploy()
    finally:
        stage.backend.close()
    assert world.double.find("Job", "dsv41-flash-node-prep-2") is None
    stage = deploy_stage(world, IMAGE_A)
    try:
        stage.rollback()
    finally:
        stage.backend.close()
    assert stored_configs(world.double) == first
    assert outcomes(stage) == ["deployed", "deployed", "restored"]


def test_status_names_a_field_edited_by_hand_and_exits_with_drift(world, capsys):
    deploy(world, IMAGE_A)
    service = world.double.find("InferenceService", "dsv41-flash")
    # What `kubectl edit` does: one env value changed, one entry added.
    env = service["spec"]["env"]
    old = next(e for e in env if e["name"] == "NCCL_DEBUG")["value"]
    next(e for e in env if e["name"] == "NCCL_DEBUG")["value"] = "WARN"
    env.append({"name": "HAND_MADE", "value": "1"})
    stage = deploy_stage(world, IMAGE_A)
    capsys.readouterr()
    with pytest.raises(Drift) as err:
        try:
            stage.deployed.status()
        finally:
            stage.backend.close()
    assert err.value.exit_code == 7
    assert str(err.value).startswith("status tp3-ring: 1 member(s)/object(s) changed since")
    out = capsys.readouterr().out.splitlines()
    assert "    InferenceService/dsv41-flash in dsv41: changed since deployed" in out
    assert f'        spec.env[NCCL_DEBUG].value: "{old}" -> "WARN"' in out
    assert '        spec.env[HAND_MADE]: (absent) -> {"name": "HAND_MADE", "value": "1"}' in out


def test_status_without_drift_passes_and_says_so(world, capsys):
    deploy(world, IMAGE_A)
    stage = deploy_stage(world, IMAGE_A)
    capsys.readouterr()
    try:
        stage.deployed.status()
    finally:
        stage.backend.close()
    assert "  drift since deployed: nothing" in capsys.readouterr().out


def test_a_rollback_of_a_record_whose_kept_document_has_no_kind_is_one_line_and_applies_nothing(
    world,
):
    deploy(world, IMAGE_A)
    deploy(world, IMAGE_B)
    stage = deploy_stage(world, IMAGE_B)
    first = stage.records.history()[0]
    path = stage.records.folder / first["file"]
    record = json.loads(path.read_text())
    del record["deployment"]["documents"][3]["kind"]
    path.write_text(json.dumps(record))
    writes = len(world.double.writes())
    with pytest.raises(CorruptDeploymentRecord) as err:
        try:
            stage.rollback()
        finally:
            stage.backend.close()
    assert err.value.exit_code == 2
    assert str(err.value) == (
        f"{path}: deployment.documents[3].kind: expected a string, found nothing; nothing applied"
    )
    assert world.double.writes()[writes:] == []
    assert outcomes(stage) == ["deployed", "deployed"]


def test_a_long_value_keeps_both_ends_and_a_credential_is_never_shown():
    image = "registry.example/lab/sparkforge/vllm-gb10-dsv41-exl3@sha256:" + "c" * 64
    program = "print('x')\n" * 40
    changes = field_changes(
        {"image": image, "data": {"patch.py": program}, "env": {"AWS_SECRET_ACCESS_KEY": "n3w"}},
        {"image": "old", "data": {"patch.py": ""}, "env": {"AWS_SECRET_ACCESS_KEY": "0ld"}},
        extras=True,
    )
    lines = [change.line() for change in changes]
    assert lines[0].startswith('data[patch.py]: "" -> "print(') and lines[0].endswith('\\n"')
    assert "..." in lines[0] and len(lines[0]) < 200
    assert lines[1] == "env.AWS_SECRET_ACCESS_KEY: (value hidden) changed"
    assert lines[2] == f'image: "old" -> "{image}"'
    assert "n3w" not in "".join(lines) and "0ld" not in "".join(lines)


def test_status_reports_drift_while_the_registry_does_not_answer(world, capsys):
    deploy(world, IMAGE_A)
    world.double.find("InferenceService", "dsv41-flash")["spec"]["image"] = IMAGE_B

    def unreachable() -> str:
        raise Unreachable("registry ghcr.io unreachable (HEAD .../manifests/stable)")

    world.tags.stable_digest = unreachable
    stage = deploy_stage(world, IMAGE_A)
    capsys.readouterr()
    with pytest.raises(Drift):
        try:
            stage.deployed.status()
        finally:
            stage.backend.close()
    out = capsys.readouterr().out.splitlines()
    assert (
        "  :stable at cannot tell (registry ghcr.io unreachable (HEAD .../manifests/stable))" in out
    )
    assert f'        spec.image: "{IMAGE_A}" -> "{IMAGE_B}"' in out


def test_prune_deletes_no_collection_and_nothing_outside_the_profiles_namespace(world):
    deploy(world, IMAGE_A)
    # A list answer with an owned item that has no name (a hostile or broken API server).
    nameless = {"apiVersion": "batch/v1", "kind": "Job", "spec": {}}
    nameless["metadata"] = {"namespace": "dsv41", "labels": {OWNER_LABEL: "tp3-ring"}}
    world.double.objects[("batch/v1", "Job", "dsv41", "")] = nameless
    # And one that claims another namespace than the one listed.
    elsewhere = {"apiVersion": "batch/v1", "kind": "Job", "spec": {}}
    elsewhere["metadata"] = {"name": "x", "namespace": "kube-system"}
    elsewhere["metadata"]["labels"] = {OWNER_LABEL: "tp3-ring"}
    world.double.objects[("batch/v1", "Job", "dsv41", "x")] = elsewhere
    stage = without_member_3(deploy_stage(world, IMAGE_A))
    try:
        stage.deploy()
    finally:
        stage.backend.close()
    deletes = [r.path for r in world.double.requests if r.method == "DELETE"]
    assert deletes and not [p for p in deletes if p.endswith("/jobs") or "kube-system" in p]
    assert sorted(f"{e['kind']}/{e['name']}" for e in stage.records.history()[-1]["pruned"]) == (
        sorted([*MEMBER_3, "Job/x"])
    )
