"""The three-way gate over repeated runs: passed, regressed, inconclusive (with the runs that
would decide), from bootstrap intervals; and the same simulator measured again and again."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
from sim_server import Sim, make_model

from pipelines.stages.bench.failures import BenchInconclusive
from pipelines.stages.bench.gate import INCONCLUSIVE, PASSED, REGRESSED, gate_rows, judge
from pipelines.stages.bench.intervals import bootstrap_interval
from pipelines.stages.bench.load import CellSpec, run_repeated
from pipelines.stages.bench.run import gate, sweep_body
from pipelines.stages.bench.tasks import outcome

WINDOW = SimpleNamespace(metric="decode.c1.median_window_tok_s", value=400.0, tolerance=0.05,
                         better="higher")  # fmt: skip


def runs(*values: float) -> dict:
    """Results whose c1 cell ran once per value."""
    repeats = [{"median_window_tok_s": v} for v in values]
    return {"decode": [{"name": "c1", "summary": repeats[0], "repeats": repeats}]}


def test_the_gate_reads_the_interval_passed_regressed_or_inconclusive():
    assert judge(runs(398.0, 402.0, 400.0), WINDOW).verdict == PASSED
    slow = judge(runs(360.0, 366.0, 363.0), WINDOW)
    assert slow.verdict == REGRESSED
    assert slow.line.startswith("decode.c1.median_window_tok_s: 363 against baseline 400 (-9.2%")
    assert slow.line.endswith("; 95% interval 360..366 over 3 runs")
    noisy = judge(runs(372.0, 396.0, 384.0), WINDOW)  # mean -4%, but one run at -7%
    assert noisy.verdict == INCONCLUSIVE
    assert noisy.line == (
        "decode.c1.median_window_tok_s: 384 against baseline 400 (-4.0%; tolerance 5% lower):"
        " inconclusive: the 95% interval 372..396 over 3 runs spans the limit 380;"
        " about 24 more runs would decide"
    )
    # Mean beyond the tolerance (-6.7%) but one run within it: not regressed for sure.
    assert judge(runs(356.0, 390.0, 374.0), WINDOW).verdict == INCONCLUSIVE
    # One run: its value is the interval, compared as a single number as before.
    assert judge(runs(381.0), WINDOW).verdict == PASSED
    assert judge(runs(379.0), WINDOW).verdict == REGRESSED
    (row,) = gate_rows(runs(372.0, 396.0, 384.0), [WINDOW])
    assert (row["verdict"], row["runs"], row["interval"]) == (INCONCLUSIVE, 3, [372.0, 396.0])


def test_the_interval_is_the_same_on_every_read_and_narrows_with_agreeing_runs():
    values = [10.13, 11.71, 12.02, 10.55, 11.38, 9.87, 12.44, 10.96]
    assert all(bootstrap_interval(values) == bootstrap_interval(list(values)) for _ in range(5))
    low, high = bootstrap_interval(values)
    assert 9.87 < low < 11.13 < high < 12.44
    assert bootstrap_interval([7.0]) == (7.0, 7.0)
    assert BenchInconclusive("x").exit_code == 5


@pytest.mark.timing
@pytest.mark.timing_apart  # its 37 s beside the other timing tests' 20 (scripts/test)
def test_ten_benches_of_one_server_never_flip_and_8_percent_slower_is_regressed_each_time(
    tmp_path,
):
    # A window (tokens 129..641) of 256 ms, its spread the simulator's own pace, drawn within 2%
    # per request. Not shorter: at 8000 tokens/s (64 ms) the margins were the same on an idle
    # machine, but a few milliseconds of a noisy one's scheduling moved a window 2.5% and a run
    # of "8% slower" read inconclusive. Four tokens a chunk: fewer wake-ups for server and client.
    decode = 2000.0
    gated = SimpleNamespace(metric="decode.c1.median_window_tok_s", value=decode,
                            tolerance=0.05, better="higher")  # fmt: skip

    def ten_benches(name: str, rate: float, folder: str) -> list[str]:
        """The verdicts of ten benches of a simulator decoding at rate."""
        settings = {"SIM_TTFT_S": "0.01", "SIM_DECODE_TOK_S": str(rate),
                    "SIM_DECODE_JITTER": "0.02", "SIM_TOKENS_PER_CHUNK": "4"}  # fmt: skip
        sim = Sim(make_model(tmp_path / folder), settings)
        found = []
        try:
            # Three requests a run, the median of their windows: one stalled stream is outvoted.
            spec = CellSpec("c1", 1, 3, sweep_body("sim", 16, 700), 30)
            for _ in range(10):
                cell = run_repeated(sim.url, spec, 3)
                (row,) = gate_rows({"decode": [cell.as_json()]}, [gated])
                found.append(row["verdict"])
                low, high = row["interval"]
                print(f"{name}: {row['verdict']} {row['measured']:.0f} [{low:.0f}, {high:.0f}]")
        finally:
            sim.stop()
        return found

    # The two servers side by side, each benched from a thread of this process: servers and
    # clients sleep between chunks (20 CPU s in the test's 38, the four together), so they meet
    # neither on the idle machine's cores nor on the GIL: the slower server's highest upper end
    # 1.4 to 1.9% under the limit in four runs, as one after the other (1.7%), in half the time.
    names = ("same", "8% slower")
    with ThreadPoolExecutor(2) as pool:
        found = pool.map(ten_benches, names, (decode, decode * 0.92), ("a", "b"))
        verdicts = dict(zip(names, found, strict=True))
    assert REGRESSED not in verdicts["same"] and PASSED not in verdicts["8% slower"]
    assert verdicts["8% slower"] == [REGRESSED] * 10


def test_a_run_the_gate_cannot_decide_ends_with_exit_5_naming_the_metric(tmp_path):
    # What `doit bench` does with a gated run: gate() lists what it cannot decide, and the
    # stage's outcome is BenchInconclusive (5), not passed (0), and not a regression (4).
    results = {**runs(372.0, 396.0, 384.0), "failures": []}
    gate(results, [WINDOW])
    ended = outcome(results, [WINDOW], "local", tmp_path / "report.md")
    assert isinstance(ended, BenchInconclusive) and ended.exit_code == 5
    assert str(ended) == (
        f"bench local inconclusive (report {tmp_path / 'report.md'}): nothing regressed for"
        " sure, but:\n  decode.c1.median_window_tok_s: 384 against baseline 400 (-4.0%;"
        " tolerance 5% lower): inconclusive: the 95% interval 372..396 over 3 runs spans the"
        " limit 380; about 24 more runs would decide"
    )
    decided = {**runs(398.0, 402.0, 400.0), "failures": []}
    assert outcome(gate(decided, [WINDOW]), [WINDOW], "local", tmp_path / "report.md") is None
