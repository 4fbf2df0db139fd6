"""Bench runs across deployments: each run indexed by its deployment, `doit bench_history`
plotting the gated metrics over the last deployments, `python -m pipelines.stages.bench compare`."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from sim_server import Sim, make_model

from pipelines.core.paths import REPO_ROOT
from pipelines.stages.bench.history import INDEX, last_deployments, read_history
from pipelines.stages.bench.load import CellSpec, run_repeated
from pipelines.stages.bench.report import write_results
from pipelines.stages.bench.run import gate, sweep_body

DECODE = 3000.0
BASELINE = [SimpleNamespace(metric="decode.c1.median_window_tok_s", value=DECODE,
                            tolerance=0.05, better="higher")]  # fmt: skip
# Five deployments of local: the third 20% slower.
SPEEDS = (1.0, 1.0, 0.8, 1.0, 1.0)


def bench_run(area: Path, tmp: Path, n: int, speed: float) -> Path:
    """One bench run of deployment n (its own image digest) against a simulator at speed."""
    sim = Sim(make_model(tmp / f"model{n}"), {"SIM_TTFT_S": "0.01",
                                              "SIM_DECODE_TOK_S": str(DECODE * speed)})  # fmt: skip
    try:
        cell = run_repeated(sim.url, CellSpec("c1", 1, 1, sweep_body("sim", 16, 700), 30), 3)
    finally:
        sim.stop()
    started = time.time()
    provenance = {"profile": "local", "endpoint": sim.url, "image": f"sim@sha256:{n}" + "0" * 63,
                  "manifests_key": f"{n}" * 64, "lock_sha256": "1" * 64, "deployed_git": f"g{n}",
                  "git": f"g{n}", "started": started}  # fmt: skip
    results = {"provenance": provenance, "failures": [], "probes": [],
               "decode": [cell.as_json()], "saturation": None, "needles": []}  # fmt: skip
    folder = area / time.strftime(f"%Y%m%dT%H%M%S{n}Z", time.gmtime(started))
    write_results(folder, gate(results, BASELINE))
    return folder


def command(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`python -m ARGS` from the checkout, with the test's store and no stack."""
    (tmp / "stack").mkdir(exist_ok=True)
    env = {**os.environ, "SPARKFORGE_STORE": str(tmp / "store"),
           "SPARKFORGE_STACK_DIR": str(tmp / "stack")}  # fmt: skip
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip


@pytest.mark.stack  # five simulator runs and two commands: seconds, not the fast lane
def test_five_deployments_of_local_are_plotted_and_two_runs_compared(tmp_path):
    area = tmp_path / "store" / "bench" / "local"
    runs = [bench_run(area, tmp_path, n, speed) for n, speed in enumerate(SPEEDS)]
    (area / "20000101T000000Z").mkdir()
    (area / "20000101T000000Z" / INDEX).write_text('{"profile": "loc')

    entries, skipped = read_history(area)
    verdicts = [e.verdict for e in entries]  # a loaded machine may leave one undecided
    assert verdicts[2] == "failed" and set(verdicts[:2] + verdicts[3:]) <= {
        "passed",
        "inconclusive",
    }
    assert [e.deployment.deployed_git for e in last_deployments(entries, 10)] == [
        f"g{n}" for n in range(5)
    ]
    assert [e.deployment.deployed_git for e in last_deployments(entries, 3)] == ["g2", "g3", "g4"]
    (bad,) = skipped
    assert bad.startswith(f"{area / '20000101T000000Z' / INDEX}: not valid JSON")

    plotted = command(tmp_path, "doit", "bench_history", "profile=local")
    out = plotted.stdout + plotted.stderr
    assert plotted.returncode == 0, out
    assert f"bench: left out: {bad}" in out and f"bench: history {area / 'history.png'}" in out
    assert (area / "history.png").stat().st_size > 10_000
    if keep := os.environ.get("BENCH_HISTORY_PLOT"):
        shutil.copyfile(area / "history.png", keep)

    # The reference: a full-speed run the gate passed (one that a busy moment slowed is
    # inconclusive, its median anywhere in a wide interval; CI once saw 2533 [1598..3000]).
    ref = next((n for n in (1, 0, 3, 4) if verdicts[n] == "passed"), 1)
    compared = command(tmp_path, "pipelines.stages.bench", "compare", str(runs[ref]), str(runs[2]))
    assert compared.returncode == 0, compared.stderr
    first = compared.stdout.splitlines()[0]
    assert first == f"{runs[ref]} ({verdicts[ref]}) -> {runs[2]} (failed)"
    lines = compared.stdout.splitlines()
    window = next(x for x in lines if x.startswith("c1.median_window_tok_s: "))
    found = re.search(
        r": ([0-9.]+) \[[0-9.]+\] -> ([0-9.]+) \[[0-9.]+\] ([+-][0-9.]+)% "
        r"\(intervals (apart|overlap)\)$",
        window,
    )
    assert found, window
    before, after, change = float(found[1]), float(found[2]), float(found[3])
    assert abs(change - 100 * (after - before) / before) < 0.15, window  # the change it prints
    if verdicts[ref] == "passed":  # the simulator 20% slower, against a run the gate trusted
        assert -40 < change < -15, window  # a busy moment only slows the slow run further
    assert f"gate decode.c1.median_window_tok_s: {verdicts[ref]} -> regressed" in lines

    missing = command(
        tmp_path, "pipelines.stages.bench", "compare", str(runs[0]), str(area / "nope")
    )
    assert missing.returncode == 2 and missing.stdout == ""
    assert missing.stderr == (
        f"error: {area / 'nope'}: no such run (expected a run's folder,"
        " <store>/bench/PROFILE/TIME)\n"
    )


def test_a_run_index_with_a_field_of_the_wrong_type_is_one_line_exit_2(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    entry = {"profile": "local", "started": 1.0, "verdict": "passed", "deployment": {},
             "gate": [{"metric": "m", "baseline": "fast", "tolerance": 0.1, "better": "higher"}],
             "cells": {}}  # fmt: skip
    (run / INDEX).write_text(json.dumps(entry))
    result = command(tmp_path, "pipelines.stages.bench", "compare", str(run), str(run))
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == (
        f"error: {run / INDEX}: field 'gate.0.baseline': expected `float`, got `str`\n"
    )


def test_two_deployments_of_one_image_and_commit_have_two_names_on_the_plot():
    # A profile's env changed (decode rate 410 -> 360): same image, same commit, two deployments.
    from pipelines.stages.bench.history import Deployment, Entry, label

    def entry(manifests_key: str) -> Entry:
        deployment = Deployment(
            image="r/local-sim@sha256:" + "6" * 64, manifests_key=manifests_key, deployed_git="2c92"
        )
        return Entry("local", 0.0, "passed", deployment, [], {})

    assert label(entry("7a4760ef" + "0" * 56)) != label(entry("d3f1e19e" + "0" * 56))
    assert label(entry("7a4760ef" + "0" * 56)).startswith("7a4760ef\n")


@pytest.mark.parametrize(
    ("a", "b", "line"),
    [
        ([100.0], [80.0], "w: 100 -> 80 -20.0% (one run each: no interval)"),
        ([100.0], [80.0, 82.0], "w: 100 -> 81 [80..82] -19.0% (one run in A: no interval)"),
        ([100.0, 102.0], [80.0], "w: 101 [100..102] -> 80 -20.8% (one run in B: no interval)"),
        ([100.0, 102.0], [80.0, 82.0], "w: 101 [100..102] -> 81 [80..82] -19.8% (intervals apart)"),
    ],
    ids=["one run each", "one in A", "one in B", "runs each"],
)
def test_a_side_of_one_run_is_compared_without_an_interval(a, b, line):
    from pipelines.stages.bench.history import change_line

    assert change_line("w", a, b) == line
