"""report.html opened in a real headless Chromium: the gate's verdict and every cell in its
text, and a screenshot that is not blank; the CSVs beside it."""

from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
from PIL import Image
from sim_server import Sim, make_model
from support.browser import browser, page_text

from pipelines.stages.bench.load import CellSpec, run_repeated
from pipelines.stages.bench.probes import run_probes
from pipelines.stages.bench.report import write_results
from pipelines.stages.bench.run import gate, sweep_body


@pytest.mark.stack  # a browser and a simulator: seconds, not the fast lane
def test_report_html_shows_the_verdict_and_every_cell_in_a_real_browser(tmp_path):
    sim = Sim(make_model(tmp_path / "model"), {"SIM_TTFT_S": "0.02", "SIM_DECODE_TOK_S": "3000"})
    try:
        probes = run_probes(sim.url, "sim", 131072, 30)
        cells = [run_repeated(sim.url, CellSpec(f"c{c}", c, c, sweep_body("sim", 64, 700), 30), 3)
                 for c in (1, 2)]  # fmt: skip
    finally:
        sim.stop()
    results = {
        "provenance": {"profile": "local", "endpoint": sim.url, "model": "sim",
                       "image": "sim@sha256:" + "1" * 64, "git": "abc123"},  # fmt: skip
        "failures": [], "probes": [p.as_json() for p in probes],
        "decode": [c.as_json() for c in cells], "saturation": None, "needles": [],
    }  # fmt: skip
    baseline = [SimpleNamespace(metric="decode.c1.median_window_tok_s", value=3000.0,
                                tolerance=0.05, better="higher")]  # fmt: skip
    _, report = write_results(tmp_path / "run", gate(results, baseline))
    page = report.parent / "report.html"

    shown = browser("--dump-dom", page.as_uri())
    assert shown.returncode == 0, shown.stderr
    text = page_text(shown.stdout)
    saved = json.loads((report.parent / "results.json").read_text())
    verdict = saved["verdict"]  # passed, unless a loaded machine made it inconclusive
    assert verdict in ("passed", "inconclusive") and f"Verdict: {verdict}" in text
    rows = list(csv.DictReader(io.StringIO((report.parent / "cells.csv").read_text())))
    assert [r["cell"] for r in rows] == ["c1", "c2"]
    for row in rows:  # every cell, with its figures as the CSV has them
        assert " ".join([row["cell"], row["concurrency"], "3", row["completed"], "0",
                         row["agg tok/s"], row["window tok/s"]]) in text  # fmt: skip
        for metric in ("TTFT", "ITL"):  # the server's median (from buckets) beside the client's
            client, server = row[f"{metric} median ms"], row[f"server {metric} median ms (buckets)"]
            assert server != "-" and f"{client} {server}" in text
        for metric in ("TTFT", "ITL", "E2EL"):  # the server's mean beside the client's
            client, server = row[f"{metric} mean ms"], row[f"server {metric} mean ms"]
            assert server != "-" and f"{client} {server}" in text and float(server) > 0
            # How closely they agree is a timing test's to say, on an idle machine
            # (test_bench.py's TTFT test, within 3%): here a busy machine's client reads late.
    (row,) = saved["gate"]
    low, high = row["interval"]
    assert (
        f"decode.c1.median_window_tok_s 3000 {row['measured']:.4f} {low:.4g}..{high:.4g} 3" in text
    )
    assert f"5% (higher is better) {row['verdict']}" in text
    assert text.count("data:image/png") == 0 and shown.stdout.count("data:image/png;base64,") == 3
    requests = list(csv.DictReader(io.StringIO((report.parent / "requests.csv").read_text())))
    assert len(requests) == 3 * 1 + 3 * 2 and all(r["error"] == "" for r in requests)

    shot = Path(os.environ.get("BENCH_PAGE_SCREENSHOT", tmp_path / "report.png"))
    taken = browser(f"--screenshot={shot}", "--window-size=1280,2400", page.as_uri())
    assert taken.returncode == 0 and shot.is_file(), taken.stderr
    with Image.open(shot) as opened:
        image = opened.convert("RGB")
    pixels = list(image.get_flattened_data())
    inked = sum(1 for px in pixels if sum(px) < 600)  # not near-white
    assert image.size == (1280, 2400) and len(set(pixels)) > 50 and inked > len(pixels) // 100
