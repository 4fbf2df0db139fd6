"""`doit bench` after `doit deploy` on the local stack: results, report and plots, and a gate
that fails a deployment slower than its baseline."""

from __future__ import annotations

import json

import yaml
from support.deploying import bench_results, deploy_variant, deployed, doit, records


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


def test_a_simulator_set_20_percent_slower_fails_the_bench_naming_the_metric(world):
    slower = json.loads(json.dumps(world["profile"]))
    slower["simulator"]["decode_tok_s"] *= 0.8
    path = world["profiles"] / f"{world['name']}.yaml"
    try:
        assert deploy_variant(world, slower).returncode == 0
        path.write_text(yaml.safe_dump(slower))
        result = doit(world, "bench")
    finally:
        path.write_text(yaml.safe_dump(world["profile"]))
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "decode.c1.median_window_tok_s: 3" in output and "(-20.0%" in output
    folder = bench_results(world)[-1]
    assert json.loads((folder / "results.json").read_text())["verdict"] == "failed"
    deployed(world)  # the test's own profile again, for the tests after this one
