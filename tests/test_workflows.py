"""The GitHub workflows pass actionlint (with shellcheck) and zizmor, offline; both fail on an
action that is not pinned by commit SHA; docs/ci.md names every secret and variable they use;
deploy stages the Docker-host rings' weights (not one member's), and outlasts its own waits;
zizmor's auditor persona finds only what docs/ci.md justifies, only main's build signs, and
deploy and bench refuse any other ref, and any profile not among their choices, in their first
step."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipelines.core.settings import read_settings

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
WORKFLOWS = sorted((REPO / ".github" / "workflows").glob("*.yml"))
PINNED_CHECKOUT = re.compile(r"uses: actions/checkout@[0-9a-f]{40} # v[0-9.]+")


def actionlint(github: Path, workflows: list[Path]) -> subprocess.CompletedProcess:
    """actionlint with the repository's config, its policy checks and the pinned shellcheck."""
    return subprocess.run(
        [
            str(BIN / "actionlint"),
            "-config-file",
            str(github / "actionlint.yaml"),
            f"-shellcheck={BIN / 'shellcheck'}",
            "-pyflakes=",  # no `shell: python` steps
            "-oneline",
            "-no-color",
            *map(str, workflows),
        ],
        cwd=github.parent,
        env={"PATH": str(BIN), "HOME": str(github.parent)},
        capture_output=True,
        text=True,
    )


def zizmor(github: Path, *options: str) -> subprocess.CompletedProcess:
    """zizmor with the repository's config, offline: no online audit, no network call."""
    return subprocess.run(
        [
            str(BIN / "zizmor"),
            *options,
            "--offline",
            "--no-progress",
            "--color=never",
            "--config",
            str(github / "zizmor.yml"),
            str(github / "workflows"),
        ],
        cwd=github.parent,
        # No GH_TOKEN/GITHUB_TOKEN: nothing it could authenticate with either.
        env={"PATH": str(BIN), "HOME": str(github.parent), "ZIZMOR_OFFLINE": "true"},
        capture_output=True,
        text=True,
    )


def test_the_four_workflows_are_there():
    assert [w.name for w in WORKFLOWS] == ["bench.yml", "build.yml", "deploy.yml", "operator.yml"]


def test_every_workflow_passes_actionlint_and_its_pinning_policy():
    result = actionlint(REPO / ".github", WORKFLOWS)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout == ""


def test_every_workflow_passes_zizmor_offline():
    result = zizmor(REPO / ".github")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "No findings to report" in result.stdout


@pytest.fixture
def github_copy(tmp_path: Path) -> Path:
    """.github (workflows and both tools' configs) copied into a scratch folder."""
    return Path(shutil.copytree(REPO / ".github", tmp_path / ".github"))


@pytest.mark.parametrize("workflow", [w.name for w in WORKFLOWS])
def test_a_planted_unpinned_action_fails_both_tools(github_copy, workflow):
    path = github_copy / "workflows" / workflow
    text, planted = PINNED_CHECKOUT.subn("uses: actions/checkout@v4", path.read_text(), count=1)
    assert planted == 1, f"{workflow}: no pinned actions/checkout to unpin"
    path.write_text(text)
    line = text[: text.index("actions/checkout@v4")].count("\n") + 1

    linted = actionlint(github_copy, sorted((github_copy / "workflows").glob("*.yml")))
    assert linted.returncode == 1, linted.stdout + linted.stderr
    assert f"workflows/{workflow}:{line}:" in linted.stdout
    assert "full-length commit SHA" in linted.stdout
    assert len(linted.stdout.splitlines()) == 1, linted.stdout

    audited = zizmor(github_copy)
    assert audited.returncode != 0, audited.stdout + audited.stderr
    assert "error[unpinned-uses]" in audited.stdout
    assert f"workflows/{workflow}:{line}:" in audited.stdout
    assert "not pinned to a hash" in audited.stdout


def used_names(kind: str) -> set[str]:
    """The `secrets.X` or `vars.X` the workflows use."""
    return {
        name for w in WORKFLOWS for name in re.findall(rf"\b{kind}\.([A-Z0-9_]+)", w.read_text())
    }


def test_the_manuals_table_names_every_secret_and_variable_the_workflows_use():
    section = (REPO / "docs" / "ci.md").read_text()
    section = section[: section.index("\n## ", 1)]
    rows = [r for r in section.splitlines() if r.startswith("| `")]
    listed = {m for r in rows for m in re.findall(r"`([A-Z0-9_]+)`", r.split("|")[1])}
    used = used_names("secrets") | used_names("vars")
    assert used - listed == set(), "used by a workflow, missing from docs/ci.md's table"
    assert listed - used == set(), "in docs/ci.md's table, used by no workflow"


def test_deploy_stages_the_weights_of_exactly_the_docker_host_rings():
    """deploy.yml runs `doit stage_ring` where `doit list` names it: for the Docker-host ring,
    not for the Kubernetes one (its Jobs stage), so a renamed task cannot silently skip it."""
    import yaml

    from pipelines.core.profiles import load_profile

    deploy = yaml.safe_load((REPO / ".github" / "workflows" / "deploy.yml").read_text())
    steps = deploy["jobs"]["deploy"]["steps"]
    script = next(s["run"] for s in steps if s.get("name", "").startswith("doit stage_ring"))
    pattern = re.search(r"grep '([^']+)'", script).group(1)
    profiles = deploy[True]["workflow_dispatch"]["inputs"]["profile"]["options"]  # `on:`
    staged = {}
    for name in profiles:
        listed = subprocess.run(
            [str(BIN / "doit"), "list", f"profile={name}"],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        staged[name] = any(re.match(pattern, line) for line in listed.splitlines())
    expected = {
        name: load_profile(name).deploy == "docker" and len(load_profile(name).members) > 1
        for name in profiles
    }
    assert staged == expected
    assert True in staged.values()


def test_the_deploy_job_outlasts_its_own_waits():
    job = yaml.safe_load((REPO / ".github" / "workflows" / "deploy.yml").read_text())["jobs"]
    (deploy,) = job.values()
    waits = read_settings({})
    assert deploy["timeout-minutes"] * 60 > waits.stage_timeout_s + waits.deploy_timeout_s


# What zizmor's auditor persona still finds, each justified in docs/ci.md ("What zizmor's
# auditor persona reports"): the rings' own runners, and the test job's Debian.
JUSTIFIED_AUDITOR_FINDINGS = {
    ("self-hosted-runner", "bench.yml"),
    ("self-hosted-runner", "deploy.yml"),
    ("unpinned-images", "build.yml"),
}


def test_zizmors_auditor_persona_finds_only_what_the_manual_justifies():
    result = zizmor(REPO / ".github", "--persona=auditor")
    found = set(
        re.findall(r"^\w+\[([\w-]+)\].*\n\s*--> .*/workflows/([\w.]+):", result.stdout, re.M)
    )
    assert found == JUSTIFIED_AUDITOR_FINDINGS, result.stdout
    manual = (REPO / "docs" / "ci.md").read_text()
    justified = manual[manual.index("What zizmor's auditor persona reports") :]
    for rule, workflow in JUSTIFIED_AUDITOR_FINDINGS:
        (bullet,) = [line for line in justified.splitlines() if line.startswith(f"- `{rule}` (")]
        assert workflow in bullet


def test_only_a_push_to_main_builds_with_the_environment_that_signs():
    """The cache's signing key and write credentials come from `build-main` (main only in
    GitHub's settings); every other event's job runs in `build-read`."""
    build = yaml.safe_load((REPO / ".github" / "workflows" / "build.yml").read_text())
    job = build["jobs"]["rings"]
    chooser = " ".join(job["environment"].split())
    assert chooser == (
        "${{ github.event_name == 'push' && github.ref == 'refs/heads/main' "
        "&& 'build-main' || 'build-read' }}"
    )
    signing = [s for s in job["steps"] if "SPARKFORGE_CACHE_SIGNING_KEY" in str(s.get("env", {}))]
    assert [s["if"] for s in signing] == ["github.event_name == 'push'"]


def test_only_mains_build_step_holds_the_attestation_signing_key():
    """SPARKFORGE_SIGNING_KEY appears once in all the workflows: the env of build.yml's push
    step (which runs in `build-main`); deploy and bench only trust public keys."""
    holders = []
    for path in sorted((REPO / ".github" / "workflows").glob("*.yml")):
        for name, job in yaml.safe_load(path.read_text())["jobs"].items():
            for where in [job, *job.get("steps", [])]:
                if "SPARKFORGE_SIGNING_KEY" in (where.get("env") or {}):
                    holders.append((path.name, name, where.get("if")))
    assert holders == [("build.yml", "rings", "github.event_name == 'push'")]


def first_step_run(
    workflow: str, github: dict[str, str], profile: str = "tp3-ring"
) -> subprocess.CompletedProcess:
    """The workflow's first step run by bash, its `env` filled from the `github` context given,
    for the job's matrix profile."""
    job = yaml.safe_load((REPO / ".github" / "workflows" / workflow).read_text())["jobs"]
    (first, *_) = next(iter(job.values()))["steps"]
    env = {
        name: re.sub(r"\$\{\{ github\.([\w.]+) \}\}", lambda m: github.get(m[1], ""), value)
        for name, value in first["env"].items()
    }
    return subprocess.run(
        ["bash", "-euo", "pipefail", "-c", first["run"]],
        env={"PATH": "/usr/bin:/bin", "PROFILE": profile, **env},
        capture_output=True,
        text=True,
    )


@pytest.mark.parametrize("workflow", ["deploy.yml", "bench.yml"])
def test_deploy_and_bench_refuse_a_ref_other_than_main_in_their_first_step(workflow):
    verb = workflow.removesuffix(".yml")
    dispatched = first_step_run(workflow, {"ref": "refs/heads/try-this"})
    assert dispatched.returncode == 2
    assert dispatched.stdout == (
        f"::error::{verb} runs main only: ref refs/heads/try-this is not refs/heads/main"
        " (dispatch it from main)\n"
    )
    chained = first_step_run(
        workflow, {"ref": "refs/heads/main", "event.workflow_run.head_branch": "try-this"}
    )
    assert chained.returncode == 2
    assert "ref try-this is not refs/heads/main" in chained.stdout
    for main in (
        {"ref": "refs/heads/main"},
        {"ref": "refs/heads/main", "event.workflow_run.head_branch": "main"},
    ):
        passed = first_step_run(workflow, main)
        assert (passed.returncode, passed.stdout) == (0, "")


@pytest.mark.parametrize("workflow", ["deploy.yml", "bench.yml"])
def test_deploy_and_bench_refuse_a_profile_not_among_the_dispatch_choices_in_one_line(workflow):
    """The first step knows exactly the dispatch's choices: SPARKFORGE_RING_PROFILES (and act)
    can name any other, which stops there, not in doit after the install."""
    verb = workflow.removesuffix(".yml")
    on = yaml.safe_load((REPO / ".github" / "workflows" / workflow).read_text())[True]
    choices = on["workflow_dispatch"]["inputs"]["profile"]["options"]
    for profile in choices:
        passed = first_step_run(workflow, {"ref": "refs/heads/main"}, profile)
        assert (passed.returncode, passed.stdout) == (0, ""), profile
    refused = first_step_run(workflow, {"ref": "refs/heads/main"}, "tp5-ring")
    assert refused.returncode == 2
    assert refused.stdout == (
        f"::error::{verb}: no profile 'tp5-ring' (expected tp3-ring, tp4-ring, local or"
        " local-ring)\n"
    )
