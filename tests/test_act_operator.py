"""The real operator.yml run by act: the operator's repository (a scratch one the test writes,
laid out like llmkube's) checked out beside the project with its history, and `crds check`
failing the job with what moved when its HEAD is past the commit the schemas record."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
import yaml
from support.act import REPO, run_act, uv_settings, wheelhouse
from support.operator_repo import git, operator_repo

from pipelines.stages.render.crds import derive

pytestmark = pytest.mark.stack  # act and a job's venv: tens of seconds, not the fast lane
SCHEMAS = "manifests/schemas/llmkube"


def test_the_weekly_operator_check_fails_with_what_moved_in_the_operators_crds(tmp_path):
    operator = operator_repo(tmp_path)
    recorded = git(operator, "rev-parse", "HEAD").strip()
    # The project as CI checks it out, its schemas derived from this operator's commit.
    project = tmp_path / "project"
    subprocess.run(["git", "clone", "-q", str(REPO), str(project)], check=True)
    shutil.rmtree(project / SCHEMAS)
    derive(operator, recorded, project / SCHEMAS)
    git(project, "add", "-A", SCHEMAS)
    git(project, "commit", "-q", "-m", "schemas of the scratch operator")
    # The operator moves on: a field, and a rule on an existing one.
    crd_file = operator / "config/crd/bases/inference.llmkube.dev_inferenceservices.yaml"
    body = yaml.safe_load(crd_file.read_text())
    spec = body["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    spec["properties"]["maxPodLifetimeSeconds"] = {"type": "integer", "minimum": 0}
    spec["properties"]["gpu"]["x-kubernetes-validations"].append(
        {"rule": "self.count > 0", "message": "one GPU or more"}
    )
    crd_file.write_text(yaml.safe_dump(body))
    git(operator, "commit", "-q", "-am", "later")
    head = git(operator, "rev-parse", "HEAD").strip()

    run = run_act(
        "operator.yml",
        "workflow_dispatch",
        {},
        folder=tmp_path / "act",
        secrets={},
        variables={},
        env={
            "PIP_NO_INDEX": "1",
            "PIP_FIND_LINKS": str(wheelhouse()),
            **uv_settings(),
            **{k: v for k, v in os.environ.items() if k == "PIP_CACHE_DIR"},
            "LANG": "C.UTF-8",
        },
        repository="lab/sparkforge",
        platforms=("ubuntu-24.04",),
        checkout=project,
        other_repositories={"defilantech/LLMKube": operator},
    )
    assert run.returncode != 0, run.log[-3000:]
    assert f"checked out {head}" in run.log  # the operator's main, its history with it
    for line in (
        "byte-identical to what config/crd/bases/inference.llmkube.dev_models.yaml derives to",
        f"InferenceService at HEAD {head[:12]} against inferenceservice.json:",
        "+ .spec.gpu rule: self.count > 0",
        "+ .spec.maxPodLifetimeSeconds (integer)",
        "error: config/crd/bases/inference.llmkube.dev_inferenceservices.yaml: 2 change(s)"
        f" since {recorded[:12]}",
    ):
        assert line in run.log, f"{line!r} not in the job's log:\n{run.log[-3000:]}"
