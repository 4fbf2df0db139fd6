"""Exit codes CI can act on, each produced through the real command line: 2 bad input, 3 a
service unreachable or nothing to measure, 4 a gate regression, 130 interrupted (README's
"Exit codes"); no stack: every run here points SPARKFORGE_STACK_DIR at an empty folder."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
import yaml
from sim_server import Sim, make_model
from support.signals import default_signals

from pipelines.core.paths import REPO_ROOT

PROFILES = REPO_ROOT / "pipelines" / "profiles"
SERVED = "DeepSeek-V4.1-Flash-EXL3"  # the local profile's served name


def run(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """`python -m ARGS` in the checkout, with a store, a stopped stack and env of its own."""
    (tmp_path / "stack").mkdir(exist_ok=True)
    full = {
        **os.environ,
        "SPARKFORGE_STORE": str(tmp_path / "store"),
        "SPARKFORGE_STACK_DIR": str(tmp_path / "stack"),
        **env,
    }
    command = [sys.executable, "-m", *args]
    return subprocess.run(command, cwd=REPO_ROOT, env=full, capture_output=True, text=True)


def local_profile(folder: Path, **bench: object) -> Path:
    """A profiles folder whose `local` has the given bench settings (the rest is the shipped)."""
    folder.mkdir(parents=True, exist_ok=True)
    profile = yaml.safe_load((PROFILES / "local.yaml").read_text())
    profile["bench"] = {**profile["bench"], **bench}
    (folder / "local.yaml").write_text(yaml.safe_dump(profile))
    return folder


def deployed(tmp_path: Path) -> None:
    """A record of a live local deployment, as `doit deploy` leaves it (the bench's input), and
    the endpoints of a stack that is not there (the deployment's backend reads them; no task
    here reaches them: the bench asks SPARKFORGE_BENCH_URL)."""
    stack = tmp_path / "stack"
    stack.mkdir()
    nowhere = {"s3_url": "http://127.0.0.1:9", "s3_region": "us-east-1",
               "registry": "127.0.0.1:9", "docker_host": f"unix://{stack}/docker.sock",
               "started": [], "s3_buckets": ["models"]}  # fmt: skip
    (stack / "endpoints.json").write_text(json.dumps(nowhere))
    store = tmp_path / "store"
    folder = store / "deployments" / "local"
    folder.mkdir(parents=True)
    deployment = {"key": "0" * 64, "documents": [{"address": "127.0.0.1", "port": 9}],
                  "image": "sim@sha256:" + "0" * 64, "engines": []}  # fmt: skip
    record = {
        "outcome": "deployed",
        "deployment": deployment,
        "image": deployment["image"],
        "lock_sha256": "0" * 64,
        "git": "test",
        "finished": time.time(),
        "who": "test",
    }
    (folder / f"{time.time_ns()}.json").write_text(json.dumps(record))


@pytest.fixture
def fast_sim(tmp_path):
    """A simulator serving the local profile's model, fast enough for a bench in seconds."""
    settings = {
        "SIM_SERVED_MODEL_NAME": SERVED,
        "SIM_MAX_MODEL_LEN": "131072",
        "SIM_TTFT_S": "0.01",
        "SIM_PREFILL_TOK_S": "1000000",
        "SIM_DECODE_TOK_S": "50000",
    }
    sim = Sim(make_model(tmp_path / "model"), settings)
    yield sim
    sim.stop()


SMALL_BENCH = {"concurrency": [1], "max_tokens": 700, "saturation_streams": 1,
               "saturation_tokens": 64, "needles": [], "request_timeout_s": 30.0}  # fmt: skip


def test_a_profile_with_a_mistyped_field_exits_2_in_one_line(tmp_path):
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    text = (PROFILES / "local.yaml").read_text()
    (profiles / "local.yaml").write_text(text + "\nbenchh: {}\n")
    result = run(tmp_path, "doit", "list", SPARKFORGE_PROFILES=str(profiles))
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.startswith("error: ") and "benchh" in result.stderr
    assert len(result.stderr.splitlines()) == 1


def test_a_task_whose_stack_is_down_exits_3_naming_endpoints_json(tmp_path):
    result = run(tmp_path, "doit", "image", "profile=local")
    out = result.stdout + result.stderr
    assert result.returncode == 3, out
    assert f"{tmp_path / 'stack' / 'endpoints.json'}: missing; run `scripts/stack up`" in out
    assert "Traceback" not in out


def test_doits_own_errors_keep_doits_codes(tmp_path):
    result = run(tmp_path, "doit", "no_such_task")
    assert result.returncode == 3, result.stdout + result.stderr  # doit's "before any task"
    assert "Invalid parameter" in result.stderr


def test_a_bench_the_gate_finds_slower_than_its_baseline_exits_4(tmp_path, fast_sim):
    baseline = [{"metric": "decode.c1.output_throughput", "value": 1e9, "tolerance": 0.05,
                 "better": "higher", "source": "out of any server's reach"}]  # fmt: skip
    profiles = local_profile(tmp_path / "profiles", **SMALL_BENCH, baseline=baseline)
    deployed(tmp_path)
    result = run(
        tmp_path, "doit", "bench", "profile=local",
        SPARKFORGE_PROFILES=str(profiles), SPARKFORGE_BENCH_URL=fast_sim.url,
    )  # fmt: skip
    out = result.stdout + result.stderr
    assert result.returncode == 4, out
    assert "decode.c1.output_throughput: " in out and "against baseline 1e+09" in out
    assert "Traceback" not in out


def test_a_bench_whose_server_does_not_answer_exits_3_not_4(tmp_path):
    profiles = local_profile(tmp_path / "profiles", **SMALL_BENCH)
    deployed(tmp_path)
    result = run(
        tmp_path, "doit", "bench", "profile=local",
        SPARKFORGE_PROFILES=str(profiles), SPARKFORGE_BENCH_URL="http://127.0.0.1:9",
    )  # fmt: skip
    out = result.stdout + result.stderr
    assert result.returncode == 3, out
    assert "probe models: unreachable" in out  # and the gate's metrics: not measured


def test_a_bench_with_nothing_deployed_exits_3(tmp_path):
    result = run(tmp_path, "doit", "bench", "profile=local")
    assert result.returncode == 3, result.stdout + result.stderr
    assert "nothing deployed; run `doit deploy profile=local` first" in result.stdout


def test_the_tp3_patch_alone_in_its_job_refuses_a_config_with_exit_2(tmp_path):
    shutil.copy(REPO_ROOT / "pipelines" / "stages" / "weights" / "patch.py", tmp_path / "patch.py")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("[]")
    # -I -S: no PYTHONPATH and no site-packages, so no `pipelines`, as in the Job's image.
    command = [sys.executable, "-I", "-S", "patch.py", str(model)]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 2, result.stderr
    assert result.stderr == f"error: {model / 'config.json'}: expected a JSON object\n"
    by_module = run(tmp_path, "pipelines.stages.weights.patch", str(model))
    assert (by_module.returncode, by_module.stderr) == (2, result.stderr)


def test_ctrl_c_exits_130_without_a_traceback(tmp_path):
    settings = {"SIM_SERVED_MODEL_NAME": "sim", "SIM_DECODE_TOK_S": "2", "SIM_TTFT_S": "0.01"}
    sim = Sim(make_model(tmp_path / "model"), settings)
    try:
        command = [sys.executable, "-m", "pipelines.stages.bench", "probes", "--url", sim.url,
                   "--model", "sim"]  # fmt: skip
        probes = subprocess.Popen(
            command, cwd=REPO_ROOT, stderr=subprocess.PIPE, text=True, preexec_fn=default_signals
        )
        deadline = time.monotonic() + 30
        while not busy(sim.url):  # interrupted inside a request, not while importing
            assert time.monotonic() < deadline and probes.poll() is None
            time.sleep(0.05)
        probes.send_signal(signal.SIGINT)
        _, err = probes.communicate(timeout=30)
        assert probes.returncode == 130, err
        assert "Traceback" not in err
    finally:
        sim.stop()


def busy(url: str) -> bool:
    """True while the simulator serves a request (its vLLM-style gauge)."""
    for line in requests.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith("vllm:num_requests_running"):
            return float(line.rsplit(" ", 1)[1]) > 0
    return False
