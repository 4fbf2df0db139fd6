"""`doit bench` after `doit deploy` on the local stack: results, report and plots, and a gate
that fails a deployment slower than its baseline."""

from __future__ import annotations

import json
import re

import pytest
import yaml
from support.deploying import (
    bench_results,
    deploy_variant,
    deployed,
    doit,
    records,
    shared_cores,
)


@pytest.fixture(scope="module")
def world(world):
    """The module's world, its timed baselines as wide as the parallel lane needs
    (support/deploying.py's shared_cores)."""
    profile = shared_cores(world["profile"])
    (world["profiles"] / f"{world['name']}.yaml").write_text(yaml.safe_dump(profile))
    return {**world, "profile": profile}


def test_bench_after_deploy_writes_results_report_and_plots_and_passes_the_gate(world):
    deployed(world)
    result = doit(world, "bench")
    assert result.returncode == 0, result.stdout + result.stderr
    folder = bench_results(world)[-1]
    assert result.stdout.rstrip().endswith(f"bench: report {folder / 'report.md'}")
    results = json.loads((folder / "results.json").read_text())
    assert results["verdict"] == "passed" and results["failures"] == []
    assert [c["concurrency"] for c in results["decode"]] == [1, 2, 4, 8]
    last = records(world)[-1]
    assert results["provenance"]["image"] == last["image"]
    assert results["provenance"]["manifests_key"] == last["deployment"]["key"]
    assert results["provenance"]["endpoint"] == world["url"]
    assert len(results["decode"][3]["requests"]) == 8  # raw timings kept
    assert (folder / "decode.png").stat().st_size > 0 and (folder / "needles.png").is_file()
    assert "## Gate" in (folder / "report.md").read_text()


def test_a_simulator_decoding_at_half_its_rate_fails_the_bench_naming_the_metric(world):
    slower = json.loads(json.dumps(world["profile"]))
    # Half: far enough below the metric's own 5% that no burst of late tokens hides it.
    slower["simulator"]["decode_tok_s"] *= 0.5
    for entry in slower["bench"]["baseline"]:
        if entry["metric"] == "decode.c1.median_window_tok_s":
            entry["tolerance"] = 0.05
    path = world["profiles"] / f"{world['name']}.yaml"
    try:
        assert deploy_variant(world, slower).returncode == 0
        path.write_text(yaml.safe_dump(slower))
        result = doit(world, "bench")
    finally:
        path.write_text(yaml.safe_dump(world["profile"]))
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert re.search(
        r"decode\.c1\.median_window_tok_s: [\d.]+ against baseline 400 \(-\d+\.\d%; tolerance 5%",
        output,
    ), output
    folder = bench_results(world)[-1]
    assert json.loads((folder / "results.json").read_text())["verdict"] == "failed"
    deployed(world)  # the test's own profile again, for the tests after this one
