"""Deploy targets in one table: every part a target names loads, and no stage asks `deploy`."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from support import stages

from pipelines.core.profiles import load_profile
from pipelines.engine.steps import Engine
from pipelines.engine.store import Store
from pipelines.stages.deploy.backends import backend_for
from pipelines.stages.fabric import Fabric
from pipelines.targets import TARGETS, load, target_of
from pipelines.targets.kubeapi import KubeAccess

PIPELINES = Path(__file__).resolve().parent.parent / "pipelines"


def test_every_part_a_target_names_loads():
    for target in TARGETS.values():
        for ref in (*target.renderers.values(), target.backend, target.launcher):
            assert callable(load(ref)), (target.name, ref)


def test_no_stage_compares_deploy_with_a_name():
    # The profile schema's own checks of the fields each value requires are the one exception.
    asks = re.compile(r"\.deploy\s*[!=]=|==\s*\S*\.deploy\b")
    found = [
        f"{path.relative_to(PIPELINES)}:{n}"
        for path in PIPELINES.rglob("*.py")
        if path.name != "profiles.py"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if asks.search(line)
    ]
    assert found == []


@pytest.mark.parametrize(
    ("name", "backend", "launcher"),
    [
        ("tp3-ring", "Kubernetes", "KubernetesLauncher"),
        ("tp4-ring", "DockerHosts", "DockerLauncher"),
        ("local", "DockerHosts", "DockerLauncher"),
    ],
)
def test_each_profile_gets_its_targets_backend_and_launcher(tmp_path, name, backend, launcher):
    profile = load_profile(name)
    made = backend_for(profile, ("unix:///nowhere.sock",), 1.0, KubeAccess())
    assert type(made).__name__ == backend
    engine = Engine(Store(tmp_path / "store"))
    fabric = Fabric(
        stages.context(profile, engine),
        render=stages.render_stage(profile, engine, "registry.example/x@sha256:" + "a" * 64).step,
        live=lambda: None,
    )
    assert type(fabric_launcher(fabric)).__name__ == launcher
    assert target_of(profile).stages_in_render == (backend == "Kubernetes")


def fabric_launcher(fabric: Fabric):
    """The launcher the fabric check would run its documents with."""
    from pipelines.stages.fabric.tasks import default_launcher

    return default_launcher(fabric.profile, fabric.settings)
