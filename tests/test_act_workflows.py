"""The real deploy.yml and bench.yml run by act on the self-hosted platform, against the local
stack standing in for the lab: dispatched for `local`, chained by workflow_run for `local-ring`;
the deployment record and the bench's verdict in the job summaries, the results as an artifact,
a regression failing the job, an unknown profile stopped in the first step."""

from __future__ import annotations

import fcntl
import json
import os
import re
import subprocess
import time
import uuid
from pathlib import Path

import docker
import pytest
import requests
import yaml
from support.act import (
    REPO,
    TIMEOUT_S,
    ActRun,
    Started,
    finish,
    silent_failure,
    start_act,
    uv_settings,
    wheelhouse,
)
from support.deploying import second_engine, seed_image, shared_cores
from support.ports import spare_ports
from support.registry_repos import delete_repository, key_tags

import devstack as local_stack
from pipelines.core.paths import PROFILES_DIR
from pipelines.stages.images.registry import ACCEPT

pytestmark = pytest.mark.stack
REPOSITORY = "lab/sparkforge"  # github.repository, as the workflow_run payloads name it
PLACEHOLDER_DIGEST = "sha256:" + "0" * 64
# The verdict of a bench that passed, for the local profiles (no RoCE fabric to check).
NO_FABRIC_PASSED = "passed the gate (the profile has no fabric to check)"
PIP_CACHE = os.environ.get("PIP_CACHE_DIR") or str(Path.home() / ".cache" / "pip")


@pytest.fixture(scope="module")
def lab(stack, tmp_path_factory, docker_client):
    """A lab's runner on the tests' stack: its profiles folder (local and local-ring on free
    ports), its store, its secrets and variables; the containers and images removed at the end."""
    root = tmp_path_factory.mktemp("act")
    profiles = root / "profiles"
    profiles.mkdir()
    for name in ("local", "local-ring"):
        # The workflows' plumbing, in the parallel lane: support/deploying.py's shared_cores.
        profile = shared_cores(yaml.safe_load((PROFILES_DIR / f"{name}.yaml").read_text()))
        profile["simulator"]["port"] = spare_ports(len(profile["members"]))
        if name == "local":
            # The workflows' plumbing, not the bench's numbers (tests/test_deploy_bench.py runs
            # the profile's whole bench): the sweep's ends, a shorter saturation run and one
            # needle, every baseline metric still measured (a bench of 17 s where the whole is 27).
            profile["bench"].update(concurrency=[1, 8], saturation_tokens=700, needles=[2000])
        if name == "local-ring":
            # Two members on one host stage the weights (deploy.yml's stage_ring) only with a
            # folder and a link address each, as two hosts would have (tests/test_deploy_staging).
            roots = [tmp_path_factory.mktemp(f"member{rank}") for rank in range(2)]
            profile["members"][0].update(weights_root=str(roots[0]), links={"ring-b": "127.0.0.2"})
            profile["members"][1].update(weights_root=str(roots[1]), links={"ring-a": "127.0.0.3"})
            profile["staging"] = {"port": spare_ports(), "peer_wait_s": 120}
        (profiles / f"{name}.yaml").write_text(yaml.safe_dump(profile))
    namespace = f"sparkforge-act-{uuid.uuid4().hex[:8]}"
    # local-sim in the lab's namespace under its key, as the build workflow pushes it on main
    # (the session's one build, copied): the deploy job finds it by key and trusts its
    # attestation. Building it is the image tests'; here it was a build of every act run.
    repository = f"{namespace}/sparkforge/local-sim"
    seed_image(stack, repository, root / "store", tmp_path_factory)
    credentials = local_stack.s3_credentials()
    secrets = {
        "AWS_ACCESS_KEY_ID": credentials["AWS_ACCESS_KEY_ID"],
        "AWS_SECRET_ACCESS_KEY": credentials["AWS_SECRET_ACCESS_KEY"],
        # The stack's registry takes any login; the workflow must pass one all the same.
        "SPARKFORGE_REGISTRY_USERNAME": "lab-runner",
        "SPARKFORGE_REGISTRY_PASSWORD": uuid.uuid4().hex,
        "SPARKFORGE_SSH_IDENTITY": Path(stack.ssh_identity).read_text(),
        "SPARKFORGE_SSH_KNOWN_HOSTS": Path(stack.ssh_known_hosts).read_text(),
    }
    variables = {
        "SPARKFORGE_STORE": str(root / "store"),
        "AWS_ENDPOINT_URL": stack.s3_url,
        "AWS_REGION": stack.s3_region,
        "SPARKFORGE_REGISTRY_HOST": stack.registry,
        "SPARKFORGE_REGISTRY_NAMESPACE": namespace,
        # The local profiles stage no ring: no stager image, but deploy asks for the variable.
        "SPARKFORGE_STAGER_DIGEST": PLACEHOLDER_DIGEST,
    }
    runner_env = {
        name: value
        for name, value in os.environ.items()
        if name.startswith(("SPARKFORGE_S", "SPARKFORGE_REGISTRY_PORT", "PIP_"))
    }
    runner_env.update(
        {
            "SPARKFORGE_PROFILES": str(profiles),
            "SPARKFORGE_DEPLOY_TIMEOUT": "60",
            "PIP_CACHE_DIR": PIP_CACHE,
            # The lab runner's wheelhouse (uv's wheel) and uv cache: each job installs the lock
            # asking no index (the hashes are checked all the same).
            "PIP_NO_INDEX": "1",
            "PIP_FIND_LINKS": str(wheelhouse()),
            **uv_settings(),
            "LANG": "C.UTF-8",
        }
    )
    yield {
        "root": root,
        "profiles": profiles,
        "store": root / "store",
        "secrets": secrets,
        "variables": variables,
        "env": runner_env,
    }
    engines = [docker_client, docker.DockerClient(base_url=second_engine(stack))]
    for client in engines:
        for name in ("sparkforge-local-", "sparkforge-local-ring-"):
            for container in client.containers.list(all=True, filters={"name": name}):
                container.remove(force=True)
    for image in ("local-sim", "weights-stager"):
        delete_repository(stack.registry, f"{namespace}/sparkforge/{image}")


@pytest.fixture(scope="module")
def ring_lab(lab, stack, tmp_path_factory):
    """The lab with its ring's weights-stager in its namespace, as docs/staging.md asks a lab to
    build and push once (`doit stager_image profile=local-ring`: the session's one build,
    copied), and its digest set as the variable."""
    namespace = lab["variables"]["SPARKFORGE_REGISTRY_NAMESPACE"]
    repository = f"{namespace}/sparkforge/weights-stager"
    seed_image(stack, repository, lab["store"], tmp_path_factory, image="weights-stager")
    (tag,) = key_tags(stack.registry, repository)  # the build's own tag, by its key
    base = f"http://{stack.registry}/v2/{repository}"
    digest = requests.head(f"{base}/manifests/{tag}", headers={"Accept": ACCEPT}, timeout=10)
    return {
        **lab,
        "variables": {
            **lab["variables"],
            "SPARKFORGE_STAGER_DIGEST": digest.headers["Docker-Content-Digest"],
        },
    }


def act(lab, workflow: str, event: str, payload: dict, run: str, **changes) -> ActRun:
    """The workflow run by act for the lab, in a folder of this run's own (`changes` replace
    secrets or variables)."""
    return finish(start(lab, workflow, event, payload, run, **changes))


def start(lab, workflow: str, event: str, payload: dict, run: str, **changes) -> Started:
    """act started on the workflow for the lab (as `act`)."""
    return start_act(
        workflow,
        event,
        payload,
        folder=lab["root"] / run,
        secrets={**lab["secrets"], **changes.get("secrets", {})},
        variables={**lab["variables"], **changes.get("variables", {})},
        env=lab["env"],
        repository=REPOSITORY,
    )


def records(lab, profile: str) -> list[Path]:
    """The profile's deployment records in the lab's store, oldest first."""
    return sorted((lab["store"] / "deployments" / profile).glob("*.json"))


def dispatch(profile: str) -> dict:
    """A workflow_dispatch payload from main."""
    return {
        "ref": "refs/heads/main",
        "inputs": {"profile": profile},
        "repository": {"full_name": REPOSITORY, "default_branch": "main"},
    }


def completed(workflow: str, sha: str) -> dict:
    """A workflow_run payload: `workflow`'s run of a push to main finished with success."""
    repository = {"full_name": REPOSITORY, "default_branch": "main"}
    return {
        "action": "completed",
        "workflow_run": {
            "name": workflow,
            "conclusion": "success",
            "event": "push",
            "head_branch": "main",
            "head_sha": sha,
            "head_repository": repository,
        },
        "repository": repository,
    }


def head() -> str:
    """The checkout's commit (what the stand-in checks out)."""
    done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return done.stdout.strip()


def test_a_dispatch_of_an_unknown_profile_fails_in_the_first_step_in_one_line(lab):
    run = act(lab, "deploy.yml", "workflow_dispatch", dispatch("tp5-ring"), "unknown")
    assert run.returncode != 0, run.log
    errors = [line for line in run.log.splitlines() if "::error::" in line]
    assert len(errors) == 1, run.log
    assert (
        "deploy: no profile 'tp5-ring' (expected tp3-ring, tp4-ring, local or local-ring)"
        in (errors[0])
    )
    assert "Only main, a known profile (deploy)" in run.log
    assert "checked out" not in run.log  # nothing after the first step ran
    assert run.summary == ""  # nor the summary's, which would only say doit is missing


def test_local_deployed_by_dispatch_after_waiting_on_the_lock_then_benched(lab):
    """act ignores `concurrency:`; what keeps two deploys of a profile apart on one runner is
    doit's per-profile lock beside its records: the job's deploy waits for it, saying so, then
    deploys; the bench after it records results and verdict."""
    lock = lab["store"] / "deployments" / "local.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    before = records(lab, "local")
    with lock.open("a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # as a deploy of local under way would hold it
        started = start(lab, "deploy.yml", "workflow_dispatch", dispatch("local"), "deploy-local")
        deadline = time.monotonic() + TIMEOUT_S
        while "deploy: waiting for the" not in started.log():
            assert started.process.poll() is None, started.log()
            assert time.monotonic() < deadline, started.log()
            time.sleep(1)
        time.sleep(3)
        assert records(lab, "local") == before  # nothing deployed while the other holds it
        fcntl.flock(held, fcntl.LOCK_UN)
    deployed = finish(started)
    assert deployed.returncode == 0, deployed.log
    *_, latest = after = records(lab, "local")
    assert len(after) == len(before) + 1
    record = json.loads(latest.read_text())
    assert "### deploy local" in deployed.summary
    assert f"<summary>{latest.name}</summary>" in deployed.summary
    assert latest.read_text().strip() in deployed.summary
    assert f"image {record['image']}" in deployed.summary  # doit status, above the record

    benched = act(lab, "bench.yml", "workflow_dispatch", dispatch("local"), "bench-local")
    assert benched.returncode == 0, benched.log
    (artifact,) = benched.artifacts.iterdir()
    assert artifact.name.startswith("bench-local-")
    results = json.loads((artifact / "results.json").read_text())
    assert results["verdict"] == "passed"
    assert results["provenance"]["image"] == record["image"]
    assert (artifact / "report.md").is_file()
    assert (artifact / "decode.png").stat().st_size > 0
    assert f"### bench local: {NO_FABRIC_PASSED}" in benched.summary
    assert "## Decode sweep" in benched.summary and "## Gate" in benched.summary
    assert "![" not in benched.summary  # the plots are in the artifact
    assert "AWS_SECRET_ACCESS_KEY" not in benched.log
    for secret in lab["secrets"].values():
        assert secret.strip() not in deployed.log + benched.log


def test_a_bench_made_to_regress_fails_the_job_with_the_gate_line(lab):
    path = lab["profiles"] / "local.yaml"
    profile = yaml.safe_load(path.read_text())
    stricter = json.loads(json.dumps(profile))
    for entry in stricter["bench"]["baseline"]:
        if entry["metric"] == "decode.c1.median_window_tok_s":
            # The simulator decodes at 400: two thirds below the baseline, far beyond its 5%.
            # (A third below was not far enough: on a loaded machine the simulator's tokens come
            # late, then in bursts, and one median window measured 510.9, -14.8%.)
            entry.update(value=1200.0, tolerance=0.05)
    path.write_text(yaml.safe_dump(stricter))
    try:
        benched = act(lab, "bench.yml", "workflow_dispatch", dispatch("local"), "bench-regress")
    finally:
        path.write_text(yaml.safe_dump(profile))
    assert benched.returncode != 0, benched.log
    # The gate's line, as doit bench printed it in the step's log.
    assert re.search(
        r"^\[bench/[^\]]+\]   \|   decode\.c1\.median_window_tok_s: [\d.]+ against baseline 1200"
        r" \(-\d+\.\d%; tolerance 5% lower\)$",
        benched.log,
        re.MULTILINE,
    ), benched.log
    assert "### bench local: doit bench exited 4: a regression" in benched.summary
    (artifact,) = benched.artifacts.iterdir()
    assert json.loads((artifact / "results.json").read_text())["verdict"] == "failed"


def test_the_workflow_run_chain_deploys_then_benches_local_ring(ring_lab):
    lab = ring_lab
    chain = {"variables": {"SPARKFORGE_RING_PROFILES": '["local-ring"]'}}
    sha = head()
    built = completed("build", sha)
    deployed = act(lab, "deploy.yml", "workflow_run", built, "chain-deploy", **chain)
    assert deployed.returncode == 0, deployed.log
    assert "### deploy local-ring" in deployed.summary
    record = sorted((lab["store"] / "deployments" / "local-ring").glob("*.json"))[-1]
    assert f"<summary>{record.name}</summary>" in deployed.summary
    assert f"checked out {sha}" in deployed.log

    after = completed("deploy", sha)
    benched = act(lab, "bench.yml", "workflow_run", after, "chain-bench", **chain)
    assert benched.returncode == 0, benched.log
    assert f"### bench local-ring: {NO_FABRIC_PASSED}" in benched.summary
    (artifact,) = benched.artifacts.iterdir()
    assert json.loads((artifact / "results.json").read_text())["verdict"] == "passed"


def test_build_rings_pull_request_path_renders_both_ring_profiles_on_this_runner(lab):
    """build.yml's `rings` job as a pull request runs it (plan, then the manifests rendered and
    validated around a placeholder digest, the cache read-only), on this machine instead of an
    arm64 runner; its `test` job (a debian:bookworm container, `bash .ci/run`) does not run here."""
    payload = {
        "number": 35,
        "pull_request": {"number": 35, "head": {"ref": "try-this"}, "base": {"ref": "main"}},
        "repository": {"full_name": REPOSITORY, "default_branch": "main"},
    }
    built = finish(
        start_act(
            "build.yml",
            "pull_request",
            payload,
            folder=lab["root"] / "build-pr",
            secrets={},  # build-read's read-only S3 credentials; no remote cache here
            variables={"SPARKFORGE_STAGER_DIGEST": PLACEHOLDER_DIGEST},
            # The checkout's own ring profiles, not the lab's folder of local ones.
            env={k: v for k, v in lab["env"].items() if k != "SPARKFORGE_PROFILES"},
            repository=REPOSITORY,
            platforms=("ubuntu-24.04-arm",),
            job="rings",
        )
    )
    assert built.returncode == 0, built.log
    for profile in ("tp3-ring", "tp4-ring"):
        job = rf"^\[build/doit build {profile} \(arm64\)[^\]]*\]"
        assert re.search(rf"{job}\s+\S+\s+Success - Main Manifests validated", built.log, re.M)
    assert "Image (buildx" not in built.log  # nothing built or pushed off main


def test_a_failed_step_whose_output_act_lost_is_told_from_one_that_printed():
    job, other = "[deploy/doit deploy tp5-ring]", "[deploy/doit deploy tp3-ring]"
    run, failed = "\u2b50 Run Main Only main", "  \u274c  Failure - Main Only main [5.1ms]"
    printed = f"{job} {run}\n{job}   \u2757  ::error::deploy: no profile\n{job} {failed}"
    assert silent_failure(printed) is None
    assert silent_failure(f"{job} {run}\n{job} {failed}") == f"{job} Main Only main"
    # A matrix's jobs interleave: another job's line between is not this step's output.
    interleaved = f"{job} {run}\n{other}   | pulling\n{job} {failed}"
    assert silent_failure(interleaved) == f"{job} Main Only main"
    assert silent_failure(f"{job} {run}\n{job}   \u2705  Success - Main Only main [1ms]") is None
