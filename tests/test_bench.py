"""The bench harness: exact token timing against the simulator's known timing model, failed
requests named, a busy server refused, and the gate naming the metric that regressed."""

from __future__ import annotations

import contextlib
import json
import math
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from types import SimpleNamespace

import pytest
import requests
from sim_server import Sim, make_model
from support import http_double
from support.ports import spare_ports
from support.signals import default_signals

from pipelines.core.httpjson import AnswerRefused, fetch, get_json
from pipelines.core.paths import REPO_ROOT
from pipelines.core.profiles import load_profile
from pipelines.stages.bench import needles, plots
from pipelines.stages.bench.client import stream_chat
from pipelines.stages.bench.failures import NotMeasured
from pipelines.stages.bench.gate import check_baseline, measured_all
from pipelines.stages.bench.load import CellSpec, run_cell, run_closed_loop
from pipelines.stages.bench.needles import fit_to_length, needle_prompt, server_counter
from pipelines.stages.bench.probes import probe_thinking, run_probes
from pipelines.stages.bench.record import Event, RequestRecord
from pipelines.stages.bench.report import write_results
from pipelines.stages.bench.run import cell_line, fitted_sweep_body, gate, sweep_body
from pipelines.stages.bench.serverview import (
    Metrics,
    bucket_quantile,
    histogram_medians,
    served_models,
)
from pipelines.stages.bench.sse import EventBuffer, read_chunk
from pipelines.stages.bench.timing import (
    CHUNKS,
    CONTINUOUS,
    FINAL_USAGE,
    failure_reasons,
    request_timing,
    steady_state,
    summarize,
)

# A timing model slow enough that loopback and thread overheads stay far below 2%: at 1000
# tokens/s each measure was within 0.5% of the truth in three runs, as at 500 (at 2000, 0.7%).
MODEL = {"ttft": 0.5, "prefill": 20000.0, "decode": 1000.0, "falloff": 0.5}
MAX_TOKENS = 700


def start_sim(tmp_path, **env: str) -> Sim:
    """A simulator with the test's timing model (and any SIM_* overrides)."""
    settings = {
        "SIM_TTFT_S": str(MODEL["ttft"]),
        "SIM_PREFILL_TOK_S": str(MODEL["prefill"]),
        "SIM_DECODE_TOK_S": str(MODEL["decode"]),
        "SIM_DECODE_FALLOFF": str(MODEL["falloff"]),
        **env,
    }
    return Sim(make_model(tmp_path / "model"), settings)


@pytest.fixture
def sims(tmp_path):
    """Start simulators; all stopped at the end."""
    started: list[Sim] = []

    def start(**env: str) -> Sim:
        started.append(start_sim(tmp_path / str(len(started)), **env))
        return started[-1]

    yield start
    for sim in started:
        sim.stop()


def sim_truth(sim: Sim) -> dict:
    """The server-side truth of every request since the last clear."""
    return requests.get(f"{sim.url}/sim/requests", timeout=10).json()


@pytest.mark.timing
@pytest.mark.parametrize("per_chunk", [1, 3])
@pytest.mark.parametrize("concurrency", [1, 8])
def test_ttft_window_and_aggregate_are_within_2_percent_of_the_truth(sims, concurrency, per_chunk):
    sim = sims(SIM_TOKENS_PER_CHUNK=str(per_chunk))
    body = sweep_body("sim", 256, MAX_TOKENS)
    cell = run_cell(sim.url, CellSpec("c", concurrency, concurrency, body, 60))
    s = cell.summary
    assert cell.refused is None and s["failed"] == 0 and s["method"] == CONTINUOUS
    assert s["total_output_tokens"] == concurrency * MAX_TOKENS

    prompt = cell.records[0].prompt_tokens
    ttft = MODEL["ttft"] + prompt / MODEL["prefill"]
    window = MODEL["decode"] / concurrency ** MODEL["falloff"]
    measured = [r for r in sim_truth(sim) if r["completion_tokens"] == MAX_TOKENS]
    wall = max(r["finished"] for r in measured) - min(r["received"] for r in measured)
    aggregate = sum(r["completion_tokens"] for r in measured) / wall

    assert s["median_ttft_ms"] / 1000 == pytest.approx(ttft, rel=0.02)
    assert s["median_window_tok_s"] == pytest.approx(window, rel=0.02)
    assert s["output_throughput"] == pytest.approx(aggregate, rel=0.02)
    # The role-only chunk arrives at admission, long before the first token: not counted.
    first = cell.records[0].events[0]
    assert not first.carries and first.t < ttft / 2
    # The server's own histograms, read around the cell, agree with the client. Its ITL is
    # per chunk, the client's per token: they agree where a chunk is one token.
    assert s["server_mean_ttft_ms"] == pytest.approx(s["mean_ttft_ms"], rel=0.03)
    assert s["server_mean_e2el_ms"] == pytest.approx(s["mean_e2el_ms"], rel=0.03)
    if per_chunk == 1:
        assert s["server_mean_itl_ms"] == pytest.approx(s["mean_itl_ms"], rel=0.05, abs=0.1)


def test_a_multi_token_chunk_counts_as_its_tokens():
    record = RequestRecord(started=0.0, completion_tokens=7)
    for t, tokens, carries in [(0.1, 0, False), (1.0, 1, True), (1.3, 4, True), (1.6, 7, True)]:
        record.events.append(Event(t, tokens, carries, carries))
    timing = request_timing(record)
    assert (timing.ttft, timing.e2el, timing.output_tokens) == (1.0, 1.6, 7)
    assert timing.tpot == pytest.approx(0.1)  # (1.6 - 1.0) / 6
    assert timing.itls == pytest.approx([0.1] * 6)  # each 0.3 s gap brought 3 tokens
    assert timing.method == CONTINUOUS


def test_time_to_first_content_comes_after_the_reasoning():
    thought = RequestRecord(started=0.0, completion_tokens=4)
    rows = [(0.1, 0, False, False), (0.5, 1, True, False), (0.7, 2, True, False),
            (0.9, 3, True, True), (1.1, 4, True, True)]  # fmt: skip
    thought.events = [Event(*row) for row in rows]
    plain = RequestRecord(started=0.0, completion_tokens=1)
    plain.events = [Event(0.1, 0, False, False), Event(0.3, 1, True, True)]
    reasoning_only = RequestRecord(started=0.0, completion_tokens=1)
    reasoning_only.events = [Event(0.4, 1, True, False)]
    assert (request_timing(thought).ttft, request_timing(thought).ttfc) == (0.5, 0.9)
    assert request_timing(reasoning_only).ttfc is None
    s = summarize([thought, plain, reasoning_only], 2.0)
    assert s["median_ttft_ms"] == pytest.approx(400)  # 0.5, 0.3, 0.4
    assert s["median_ttfc_ms"] == pytest.approx(600) and s["mean_ttfc_ms"] == pytest.approx(600)


def test_without_continuous_usage_the_method_says_it_is_estimated():
    spread = RequestRecord(started=0.0, completion_tokens=6)
    spread.events = [Event(t, None, True, True) for t in (1.0, 1.2, 1.4)]
    assert request_timing(spread).method == FINAL_USAGE
    assert request_timing(spread).output_tokens == 6
    # The final usage chunk comes after the text: the last token came no later than it.
    spread.events.append(Event(1.5, 6, False))
    assert request_timing(spread).e2el == 1.5 and "ends at the usage chunk" in FINAL_USAGE
    bare = RequestRecord(started=0.0)
    bare.events = [Event(t, None, True, True) for t in (1.0, 1.2, 1.4)]
    assert request_timing(bare).method == CHUNKS


def test_an_event_split_across_network_reads_is_read_once_whole():
    stream = (
        b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n'
        b'data: {"choices":[{"delta":{"content":"hi"}}],"usage":{"completion_tokens":1}}\r\n\r\n'
        b'data: {"choices":[],"usage":{"completion_tokens":1}}\n\ndata: [DONE]\n\n'
    )
    buffer = EventBuffer()
    payloads = [p for i in range(len(stream)) for p in buffer.feed(stream[i : i + 1])]
    assert len(payloads) == 4 and payloads[-1] == "[DONE]"
    role, token, usage = map(read_chunk, payloads[:3])
    assert not role.carries_token and token.carries_token and not usage.carries_token
    assert token.usage == {"completion_tokens": 1}


def events(*payloads: bytes) -> bytes:
    """A stream of these data: payloads, each its own event."""
    return b"".join(b"data: " + p + b"\n\n" for p in payloads)


TOKEN = (
    b'{"choices":[{"delta":{"content":"a"}}],"usage":{"completion_tokens":%d,"prompt_tokens":9}}'
)
# What a hostile server streams, by the model name asked: the bytes after the headers.
HOSTILE = {
    "ok": events(TOKEN % 1, TOKEN % 2, b"[DONE]"),
    "bad-utf8": events(b'{"choices":[{"delta":{"content":"\xff\xfe"}}]}', b"[DONE]"),
    "deep-json": events(b"[" * 100_000, b"[DONE]"),
    "choices-strings": events(b'{"choices":["x"]}', b"[DONE]"),
    "delta-list": events(b'{"choices":[{"delta":[1]}]}', b"[DONE]"),
    "huge-count": events(TOKEN % 100_000_000, b"[DONE]"),
    "falling-count": events(TOKEN % 5, TOKEN % 3, b"[DONE]"),
    "string-count": events(TOKEN.replace(b"%d", b'"7"'), b"[DONE]"),
    "negative-prompt": events(TOKEN.replace(b'"prompt_tokens":9', b'"prompt_tokens":-4') % 1),
    "huge-event": b"data: " + b"x" * (2 << 20),
}


class FaultServer(BaseHTTPRequestHandler):
    """Test equipment: a chat endpoint that fails the way servers do, by the model name asked."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        fault = body["model"]
        if fault == "http-500":
            data = b'{"error": {"message": "engine dead"}}'
            self.send_response(500)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        if fault == "think-in-content":  # a server without a reasoning parser
            self.wfile.write(b'data: {"choices":[{"delta":{"content":"<think>19+23</think>42"}}'
                             b'],"usage":{"completion_tokens":9}}\n\ndata: [DONE]\n\n')  # fmt: skip
            return
        if fault in HOSTILE:
            self.wfile.write(HOSTILE[fault])
            return
        self.wfile.write(b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n')
        self.wfile.flush()
        if fault == "error-body":
            self.wfile.write(b'data: {"error": {"message": "out of KV cache", "code": 500}}\n\n')
        elif fault == "slow":
            time.sleep(3)
        # "cut": the connection closes with no [DONE]


def serving(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """A server of handler on a free loopback port, its URL, for as long as the test runs."""
    with http_double.serving(handler) as url:
        yield url


@pytest.fixture
def fault_url():
    """A FaultServer on a free loopback port."""
    yield from serving(FaultServer)


@pytest.mark.parametrize(
    ("fault", "reason"),
    [
        ("error-body", "error in stream: out of KV cache"),
        ("http-500", "HTTP 500"),
        ("cut", "stream ended before [DONE]"),
        ("slow", "timeout"),
        ("bad-utf8", "malformed stream: an event that is not UTF-8"),
        ("deep-json", "error in stream: not JSON"),
        ("choices-strings", "error in stream: choices: expected a list of objects"),
        ("delta-list", "error in stream: choices[].delta: expected an object"),
        ("huge-count", "bad usage: completion_tokens 100000000: expected a whole number from"),
        ("falling-count", "bad usage: completion_tokens 3: expected a whole number from 5 to 16"),
        ("string-count", 'bad usage: completion_tokens "7": expected a whole number'),
        ("negative-prompt", "bad usage: prompt_tokens -4: expected a whole number from 0"),
        ("huge-event", "malformed stream: an event longer than 1 MiB"),
        ("unreachable", "unreachable"),
    ],
)
def test_a_failed_request_counts_as_failed_with_its_reason(fault_url, fault, reason):
    url = f"http://127.0.0.1:{spare_ports()}" if fault == "unreachable" else fault_url
    record = stream_chat(url, {"model": fault, "messages": [], "max_tokens": 16}, timeout=1)
    assert not record.ok and reason in record.error, record.error
    summary = summarize([record], duration=1.0)
    assert (summary["completed"], summary["failed"]) == (0, 1)
    assert summary["errors"][0]["count"] == 1 and reason in summary["errors"][0]["reason"]


def test_a_busy_server_makes_the_cell_refuse_to_start(sims):
    sim = sims(SIM_DECODE_TOK_S="50", SIM_MAX_RUNNING="1")
    body = sweep_body("sim", 16, MAX_TOKENS)
    hog = threading.Thread(target=stream_chat, args=(sim.url, body(0), 60), daemon=True)
    hog.start()
    time.sleep(0.3)  # the long request is running
    cell = run_cell(sim.url, CellSpec("c1", 1, 1, body, 60, warmup=0), idle_timeout=1)
    assert cell.refused and "server busy: 1 running" in cell.refused
    assert cell.records == []


def test_a_server_whose_load_cannot_be_read_makes_the_cell_refuse_to_start(sims):
    sim = sims(SIM_MISSING_ROUTES="/metrics")  # as SGLang without --enable-metrics
    body = sweep_body("sim", 16, 8)
    cell = run_cell(sim.url, CellSpec("c1", 1, 1, body, 60, warmup=0), idle_timeout=0.5)
    why = (
        f"cannot tell whether the server is idle: {sim.url}/metrics has none of"
        " vllm:num_requests_running, sglang:num_running_reqs, vllm:num_requests_waiting,"
        " sglang:num_queue_reqs"
    )
    assert cell.refused == why and cell.records == []
    assert cell_line(cell) == f"c1: refused ({why})"  # the one line the bench prints
    assert sim_truth(sim) == []  # not one request was sent


def test_probes_pass_on_the_simulator_and_a_wrong_model_name_fails_them(sims):
    sim = sims(SIM_TTFT_S="0.01", SIM_DECODE_TOK_S="2000")
    probes = run_probes(sim.url, "sim", 131072, 30)
    assert [(p.name, p.passed) for p in probes] == [
        ("models", True),
        ("arithmetic", True),
        ("thinking", True),
        ("tool_call", True),
        ("concurrent_8", True),
    ]
    (wrong,) = run_probes(sim.url, "another-model", 131072, 30)
    assert not wrong.passed and "served: ['sim']" in wrong.detail


def test_a_needle_prompt_is_fitted_to_the_servers_token_count(sims):
    sim = sims(SIM_TTFT_S="0.01")
    count = server_counter(sim.url, "sim", 30)
    units = fit_to_length(3000, count, lambda n: needle_prompt(n, "k", "1234567", "n0", 0.5))
    fitted = count(needle_prompt(units, "k", "1234567", "n0", 0.5))
    assert 3000 - 40 < fitted <= 3000  # within one filler unit below the target


def test_no_needle_request_shares_its_opening_nonce_with_another_in_a_run_or_across_runs(
    sims, monkeypatch
):
    # Without /tokenize the fit counts with one-token chat probes, which the prefix cache
    # keeps: a probe opening like the measured prompt would make its prefill free.
    sim = sims(SIM_TTFT_S="0.01", SIM_MISSING_ROUTES="/tokenize")
    timeouts = []

    def timed_stream_chat(base_url, body, timeout):
        timeouts.append(timeout)
        return stream_chat(base_url, body, timeout)

    monkeypatch.setattr(needles, "stream_chat", timed_stream_chat)
    measured = []
    for _ in range(2):  # two `doit bench` runs: run_bench passes the same seed each time
        requests.delete(f"{sim.url}/sim/requests", timeout=10)
        result = needles.run_needle(sim.url, "sim", 2000, 0.5, 1.0, seed=0)
        sent = sim_truth(sim)
        assert result.correct and len(sent) > 3  # probes, then the measured request
        nonces = [r["prompt_head"][:20] for r in sent]
        assert len(set(nonces)) == len(nonces), nonces
        assert result.prompt_tokens == sent[-1]["prompt_tokens"] <= 2000
        measured.append(sent[-1]["prompt_head"])
    assert measured[0] != measured[1]
    assert set(timeouts) == {60 + 1.0 * 2000 / 1000}  # probes wait as long as the request


BASELINE = [
    SimpleNamespace(metric="decode.c1.median_window_tok_s", value=400.0, tolerance=0.05,
                    better="higher"),
    SimpleNamespace(metric="decode.c1.median_ttft_ms", value=300.0, tolerance=0.1,
                    better="lower"),
]  # fmt: skip


def test_the_gate_names_the_metric_that_regressed_and_by_how_much():
    def results(window, ttft):
        return {"decode": [{"name": "c1", "summary": {"median_window_tok_s": window,
                                                       "median_ttft_ms": ttft}}]}  # fmt: skip

    assert check_baseline(results(390.0, 320.0), BASELINE) == []
    (slow,) = check_baseline(results(320.0, 320.0), BASELINE)
    assert slow.startswith("decode.c1.median_window_tok_s: 320 against baseline 400 (-20.0%")
    (late,) = check_baseline(results(400.0, 345.0), BASELINE)
    assert late.startswith("decode.c1.median_ttft_ms: 345 against baseline 300 (+15.0%")
    (missing,) = check_baseline({"decode": []}, BASELINE[:1])
    assert "not measured" in missing


def test_a_plot_that_fails_makes_the_saved_verdict_failed(tmp_path, monkeypatch):
    def no_plots(results, folder):
        raise OSError("No space left on device")

    def results() -> dict:
        provenance = {"profile": "local", "endpoint": "http://127.0.0.1:1"}
        return gate({"provenance": provenance, "failures": [], "probes": [], "decode": []}, [])

    data, _ = write_results(tmp_path / "plotted", results())
    assert json.loads(data.read_text())["verdict"] == "passed"
    monkeypatch.setattr(plots, "plot_results", no_plots)
    data, report = write_results(tmp_path / "unplotted", results())
    saved = json.loads(data.read_text())
    assert saved["failures"] == ["plots: OSError: No space left on device"]
    assert saved["verdict"] == "failed"
    assert "verdict: **failed**" in report.read_text()


def test_the_local_baseline_is_the_simulators_own_settings():
    profile = load_profile("local")
    sim, base = profile.simulator, {b.metric: b.value for b in profile.bench.baseline}
    per_stream_at_8 = sim.decode_tok_s / 8**sim.decode_falloff
    assert base["decode.c1.median_window_tok_s"] == sim.decode_tok_s
    assert base["decode.c8.median_window_tok_s"] == pytest.approx(per_stream_at_8, rel=1e-3)
    assert base["saturation.steady_output_throughput"] == pytest.approx(8 * per_stream_at_8, 1e-3)


def bench_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """`python -m pipelines.stages.bench ARGS` from the checkout, as a person runs it."""
    command = [sys.executable, "-m", "pipelines.stages.bench", *args]
    return subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.stack  # a simulator (and commands): seconds, not the fast lane
def test_a_cells_line_names_each_failure_reason_with_its_count(sims, fault_url):
    sim = sims(SIM_TTFT_S="0.01")
    cell = run_cell(sim.url, CellSpec("c1", 1, 2, sweep_body("nosuch", 16, 8), 30, warmup=0))
    assert cell_line(cell) == (
        "c1: 0 ok, 2 failed: 2x HTTP 404: The model `nosuch` does not exist.; 0.0 tok/s aggregate"
    )
    records = [stream_chat(fault_url, {"model": m, "messages": []}, 1) for m in
               ("cut", "error-body", "cut")]  # fmt: skip
    assert failure_reasons(summarize(records, 1.0)) == (
        "2x stream ended before [DONE]; 1x error in stream: out of KV cache"
    )


@pytest.mark.stack  # a simulator (and commands): seconds, not the fast lane
@pytest.mark.parametrize("where", ["nothing listening", "a URL ending in /v1"])
def test_a_wrong_url_is_said_at_once_and_exits_3(sims, where):
    sim = sims(SIM_TTFT_S="0.01")
    url = f"http://127.0.0.1:{spare_ports()}" if where == "nothing listening" else f"{sim.url}/v1"
    started = time.monotonic()
    result = bench_cli("cell", "--url", url, "--model", "sim", "--max-tokens", "8")
    assert time.monotonic() - started < 10  # no 30 s idle wait first
    assert result.returncode == 3 and result.stdout == ""
    (line,) = result.stderr.splitlines()
    if where == "nothing listening":
        assert line.startswith(f"error: cell c1 not measured: nothing answers at {url}: ")
    else:
        assert line == (
            f"error: cell c1 not measured: {url}/v1/models: HTTP 404: not an OpenAI-compatible"
            " server's root (give the URL without /v1)"
        )
    started = time.monotonic()  # and the pipeline's cells, through run_cell, the same
    cell = run_cell(url, CellSpec("c1", 1, 1, sweep_body("sim", 16, 8), 30))
    assert time.monotonic() - started < 5 and cell.refused == line.split("not measured: ")[1]
    assert sim_truth(sim) == []  # not one chat request


@pytest.mark.stack  # a simulator (and commands): seconds, not the fast lane
def test_a_model_not_served_is_named_and_failed_requests_exit_3_and_a_bad_option_exits_2(sims):
    sim = sims(SIM_TTFT_S="0.01", SIM_MAX_MODEL_LEN="64")
    wrong = bench_cli("cell", "--url", sim.url, "--model", "nosuch", "--max-tokens", "8")
    assert (wrong.returncode, wrong.stdout) == (3, ""), wrong.stderr
    assert wrong.stderr == (
        f"error: cell c1 not measured: the server at {sim.url} serves no model 'nosuch'"
        " (it lists: sim)\n"
    )  # not blamed on --prompt-tokens, whose counting the unknown model fails first
    long = bench_cli(  # prompts longer than the server's context: every request fails
        "cell", "--url", sim.url, "--model", "sim", "--max-tokens", "8", "--requests", "2",
        "--prompt-tokens", "100", "--warmup", "0",
    )  # fmt: skip
    assert long.returncode == 3, long.stderr
    reason = "2x HTTP 400: This model's maximum context length is 64 tokens."
    assert long.stdout.startswith(f"c1: 0 ok, 2 failed: {reason}")
    assert long.stderr.startswith(f"error: cell c1: 2 of 2 requests failed: {reason}")
    bad = bench_cli("cell", "--url", sim.url, "--model", "sim", "--requests", "0")
    assert bad.returncode == 2
    assert bad.stderr == "error: --requests: expected a whole number of 1 or more, got 0\n"


def uneven_count(prompt: str) -> int:
    """Test equipment: a tokenizer whose count moves with a nonce's letters and digits (a digit
    a token, a run of letters a token, each other mark a token)."""
    return len(re.findall(r"\d|[A-Za-z]+|[^\sA-Za-z\d]", prompt))


def test_every_prompt_is_exactly_the_length_asked_by_the_servers_count():
    make = sweep_body("m", 256, 8, uneven_count)
    lengths = {uneven_count(make(i)["messages"][0]["content"]) for i in range(40)}
    assert lengths == {256}
    # The nonces alone move this tokenizer's count: a fitted word count is not enough.
    nonces = {uneven_count(f"[{secrets.token_hex(8)}]") for _ in range(40)}
    assert len(nonces) > 1


def test_a_length_the_servers_count_cannot_land_on_is_said_and_the_cell_not_measured():
    def no_dots(prompt: str) -> int:  # dots cost nothing: the pad cannot fill the gap
        return uneven_count(prompt.replace(".", "")) // 2 * 2  # and only even counts

    with pytest.raises(NotMeasured, match=r"^--prompt-tokens 255: the server counted .* never 255"):
        sweep_body("m", 255, 8, no_dots)(0)


def test_a_dropped_decode_window_says_why():
    short = RequestRecord(started=0.0, completion_tokens=3)
    short.events = [Event(0.1 * i, i, True, True) for i in (1, 2, 3)]
    summary = summarize([short], 1.0)
    assert summary["median_window_tok_s"] is None
    assert summary["window_note"] == (
        "window measured on 0 of 1 requests: it needs 641 output tokens (tokens 129..641),"
        " the longest brought 3"
    )


def test_a_thinking_probe_that_fails_says_the_server_lacks_a_reasoning_parser(fault_url):
    probe = probe_thinking(fault_url, "think-in-content", 5)
    assert not probe.passed
    assert probe.detail == (
        "reasoning_tokens None, reasoning 0 chars; the thinking came inside the content"
        " (<think>...</think>): the server has no reasoning parser (vLLM --reasoning-parser,"
        " SGLang --reasoning-parser)"
    )


def test_steady_state_is_measured_over_the_first_wave_when_requests_exceed_streams():
    def request(started: float, ttft: float) -> RequestRecord:
        record = RequestRecord(started=started, completion_tokens=10)
        record.events = [Event(ttft + i * 0.25, i + 1, True, True) for i in range(10)]
        return record  # ten tokens, a quarter second apart (exact in binary)

    # Two streams, four requests: each stream's second request starts when its first ends.
    records = [request(0.0, 0.25), request(0.0, 0.5), request(2.5, 0.25), request(2.75, 0.25)]
    steady = steady_state(records, concurrency=2)
    assert (steady["steady_start"], steady["steady_end"]) == (0.5, 2.5)
    # In 0.5..2.5: tokens 2..10 of the first and 1..9 of the second; none of the later two.
    assert steady["steady_output_throughput"] == 18 / 2.0
    assert steady_state(records)["steady_output_throughput"] is None  # over all: no span


def test_a_cell_keeps_every_request_it_sent_whatever_the_server_streams(fault_url):
    # Half the requests answered with a broken chunk: none vanishes from the sample.
    def body(index: int) -> dict:
        return {"model": "bad-utf8" if index % 2 else "ok", "messages": [], "max_tokens": 16}

    records, duration = run_closed_loop(fault_url, CellSpec("c4", 4, 8, body, 5, warmup=0))
    assert len(records) == 8
    summary = summarize(records, duration)
    assert (summary["completed"], summary["failed"]) == (4, 4)
    assert summary["errors"] == [
        {"count": 4, "reason": "malformed stream: an event that is not UTF-8"}
    ]


class Trickle(BaseHTTPRequestHandler):
    """Test equipment: answers GETs the way a hostile server does, by path."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        self.send_response(200)
        if self.path == "/slow":  # one byte every 0.2 s, forever: never a read timeout
            self.send_header("Content-Length", "100000")
            self.end_headers()
            with contextlib.suppress(OSError):
                for _ in range(100_000):
                    self.wfile.write(b"x")
                    self.wfile.flush()
                    time.sleep(0.2)
            return
        data = b"[" * 100_000 if self.path == "/deep" else b"x" * (3 << 20)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        with contextlib.suppress(OSError):
            self.wfile.write(data)


@pytest.fixture
def trickle_url():
    """A Trickle server on a free loopback port."""
    yield from serving(Trickle)


def test_an_answer_is_bounded_in_time_and_size_whatever_the_server_sends(trickle_url):
    started = time.monotonic()
    with pytest.raises(AnswerRefused, match="no whole answer within 1 s"):
        fetch("GET", f"{trickle_url}/slow", 1)
    assert time.monotonic() - started < 3  # not the 100,000 x 0.2 s the server would take
    with pytest.raises(AnswerRefused, match="an answer over 1 MiB"):
        fetch("GET", f"{trickle_url}/big", 5, cap=1 << 20)
    assert get_json(f"{trickle_url}/deep") == (200, None)  # nested past the parser: no answer


@pytest.mark.stack  # a simulator: seconds, not the fast lane
def test_a_cells_first_wave_leaves_together_and_its_spread_is_recorded(sims):
    sim = sims(SIM_TTFT_S="0.01", SIM_DECODE_TOK_S="2000")
    one_at_a_time = threading.Lock()
    make = sweep_body("sim", 16, 8)

    def slow_body(index: int) -> dict:
        with one_at_a_time:  # as a tokenizer round trip on one connection would be
            time.sleep(0.06)
            return make(index)

    cell = run_cell(sim.url, CellSpec("c16", 16, 32, slow_body, 30, warmup=0))
    assert cell.summary["completed"] == 32
    first = sorted(r["received"] for r in sim_truth(sim))[:16]
    spread = (first[-1] - first[0]) * 1000  # by the server's clock
    # Bodies made as the wave leaves spread it over 15 x 60 ms at least; sixteen requests
    # made ahead reached the server over 175 ms once in the loaded parallel lane (2 cores).
    assert spread < 350, f"the first wave reached the server over {spread:.0f} ms"
    recorded = cell.summary["start_spread_ms"]
    assert recorded is not None and recorded < 350 and abs(recorded - spread) < 150


@pytest.mark.stack  # a simulator and a command: seconds, not the fast lane
def test_prompts_are_sent_at_exactly_the_length_asked_by_the_servers_own_usage(sims, tmp_path):
    sim = sims(SIM_TTFT_S="0.01", SIM_DECODE_TOK_S="2000")
    out = tmp_path / "cell.json"
    args = ["--url", sim.url, "--model", "sim", "--max-tokens", "8", "--concurrency", "3"]
    asked = ["--requests", "6", "--prompt-tokens", "100", "--warmup", "0", "--out", str(out)]
    done = bench_cli("cell", *args, *asked)
    assert done.returncode == 0, done.stderr
    told = [r["prompt_tokens"] for r in sim_truth(sim)]
    assert told == [100] * 6  # the server's count of each request it was sent
    assert json.loads(out.read_text())["client_stall_s"] < 1.0


@pytest.mark.stack  # a simulator and a command stopped for seconds: not the fast lane
def test_a_client_that_stalled_mid_cell_says_so_and_is_not_measured(sims):
    sim = sims(SIM_TTFT_S="0.01", SIM_DECODE_TOK_S="20")  # one request: about 3 s of decode
    asked = ["--max-tokens", "60", "--requests", "1", "--warmup", "0"]
    command = [sys.executable, "-m", "pipelines.stages.bench", "cell", "--url", sim.url]
    client = subprocess.Popen(
        [*command, "--model", "sim", *asked],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=default_signals,
    )
    try:
        deadline = time.monotonic() + 60
        while not sim_truth(sim):  # the request is in: the cell is being measured
            assert time.monotonic() < deadline, "the cell never sent its request"
            time.sleep(0.05)
        time.sleep(0.5)
        client.send_signal(signal.SIGSTOP)  # the process stops, as a starved one does
        time.sleep(1.5)
        client.send_signal(signal.SIGCONT)
        stdout, stderr = client.communicate(timeout=60)
    finally:
        client.kill()
    assert client.returncode == 3, stderr
    assert re.fullmatch(
        r"error: cell c1: the client stalled 1\.[4-9] s \(this process was not running;"
        r" tokens read late, in bursts\): not gated, run it again on a machine with CPU to"
        r" spare\n",
        stderr,
    ), stderr
    assert "the client stalled" in stdout


def test_a_run_whose_client_stalled_is_not_a_verdict_on_the_deployment():
    probes = [{"name": "models", "passed": True, "detail": ""}]
    cell = {"name": "c1", "summary": {"failed": 0, "client_stall_s": 0.2, "m": 1.0}}
    results = {"probes": probes, "decode": [cell], "saturation": None}
    assert measured_all(results, [])
    cell["summary"]["client_stall_s"] = 1.5
    assert not measured_all(results, [])


class Counts(BaseHTTPRequestHandler):
    """Test equipment: a /tokenize that answers the count named by the model asked for."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        data = b'{"count": ' + body["model"].encode() + b"}"
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.mark.parametrize(
    ("told", "shown"), [('"abc"', '"abc"'), ("1e400", "Infinity"), ("true", "true"), ("-3", "-3")]
)
def test_a_token_count_that_cannot_be_true_fails_the_fitting_in_one_line(told, shown):
    for url in serving(Counts):
        with pytest.raises(NotMeasured) as refused:
            fitted_sweep_body(url, told, 64, 8, 5)
        assert str(refused.value) == (
            f"--prompt-tokens 64: /tokenize answered count {shown}: expected a whole number"
            " from 0 to 10000000"
        )


def test_a_servers_median_is_read_from_its_buckets_as_prometheus_reads_a_quantile():
    # Cumulative counts by upper bound: 4 requests up to 0.5 s, 6 more up to 1 s, none above.
    counts = [(0.1, 0.0), (0.5, 4.0), (1.0, 10.0), (math.inf, 10.0)]
    assert bucket_quantile(0.5, counts) == pytest.approx(0.5 + 0.5 * (5 - 4) / 6)
    assert bucket_quantile(0.5, [(1.0, 1.0), (math.inf, 10.0)]) == 1.0  # past the last bound
    assert bucket_quantile(0.5, [(1.0, 0.0), (math.inf, 0.0)]) is None  # nothing observed
    before = Metrics({}, {"vllm:time_to_first_token_seconds": dict(counts)})
    after = Metrics({}, {"vllm:time_to_first_token_seconds": {b: c * 2 for b, c in counts}})
    medians = histogram_medians(before, after)  # the cell's own requests: after - before
    assert medians["server_median_ttft_ms"] == pytest.approx(1000 * bucket_quantile(0.5, counts))
    assert medians["server_median_itl_ms"] is None  # a histogram the server does not keep


def test_a_model_list_with_ids_that_are_not_names_keeps_only_the_names():
    body = {"data": [{"id": 5}, {"id": "sim"}, {"id": ["x"]}, "card", {"id": None}]}
    assert list(served_models(body)) == ["sim"]  # sorting 5 beside "sim" raised TypeError
    assert served_models({"data": "all"}) == served_models([1]) == {}
