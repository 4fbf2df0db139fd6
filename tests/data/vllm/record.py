"""Records a real vLLM server's answers to what the bench asks, as fixtures (see README.md).

Run from the checkout, beside a server:
PYTHONPATH=. python tests/data/vllm/record.py http://127.0.0.1:8399 tiny OUTDIR [TRIES]
"""

from __future__ import annotations

import copy
import json
import sys
import time
from pathlib import Path

import urllib3

from pipelines.stages.bench.client import STREAM_OPTIONS
from pipelines.stages.bench.probes import WEATHER_TOOL
from pipelines.stages.bench.run import sweep_body

# The server's own per-request figures, from /metrics read before and after one lone request.
TRUTH = {
    "e2e_s": "vllm:e2e_request_latency_seconds_sum",
    "ttft_s": "vllm:time_to_first_token_seconds_sum",
    "tpot_s": "vllm:request_time_per_output_token_seconds_sum",
    "completion_tokens": "vllm:request_generation_tokens_sum",
}

# The probe's tool, its city narrowed to one name (a random model must still spell it).
CITY_TOOL = copy.deepcopy(WEATHER_TOOL)
CITY_TOOL["function"]["parameters"]["properties"]["city"]["enum"] = ["Paris"]


def main() -> None:
    base, model, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    out.mkdir(parents=True, exist_ok=True)
    http = urllib3.PoolManager()
    if len(sys.argv) > 4:  # TRIES: the timed decode stream only, beside a slower model
        timed_decode(http, base, model, out, tries=int(sys.argv[4]))
        return

    def chat(name: str, body: dict) -> None:
        body = {"model": model, "temperature": 0, **body, "stream": True}
        body["stream_options"] = STREAM_OPTIONS
        r = http.request("POST", f"{base}/v1/chat/completions", json=body, preload_content=True)
        (out / f"{name}.sse").write_bytes(r.data)
        (out / f"{name}.status").write_text(f"{r.status} {r.headers.get('content-type')}\n")

    (out / "models.json").write_bytes(http.request("GET", f"{base}/v1/models").data)
    ask = [{"role": "user", "content": "What is 19+23? Think first."}]
    chat(
        "reasoning",
        {
            "messages": ask,
            "max_tokens": 24,
            "chat_template_kwargs": {"thinking": True, "enable_thinking": True},
        },
    )
    weather = [{"role": "user", "content": "Use get_weather: what is the weather in Paris?"}]
    chat(
        "tool-named",
        {
            "messages": weather,
            "max_tokens": 48,
            "tools": [CITY_TOOL],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "chat_template_kwargs": {"thinking": False, "enable_thinking": False},
        },
    )
    chat("too-long", {"messages": [{"role": "user", "content": "Paris " * 3000}], "max_tokens": 8})
    (out / "metrics.txt").write_bytes(http.request("GET", f"{base}/metrics").data)


def scrape(http: urllib3.PoolManager, base: str) -> dict[str, float]:
    """The /metrics samples named in TRUTH, summed over labels."""
    values = dict.fromkeys(TRUTH.values(), 0.0)
    for line in http.request("GET", f"{base}/metrics").data.decode().splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in values:
            values[name] += float(line.rsplit(" ", 1)[1])
    return values


def visible_counts(raw: bytes) -> list[tuple[int, bool]]:
    """(cumulative completion tokens, any visible text) of every chunk with choices."""
    rows = []
    for event in raw.split(b"\n\n")[:-1]:
        if event == b"data: [DONE]":
            continue
        body = json.loads(event.removeprefix(b"data: "))
        for choice in body.get("choices") or []:
            delta = choice.get("delta") or {}
            text = delta.get("content") or delta.get("reasoning") or delta.get("tool_calls")
            rows.append((body["usage"]["completion_tokens"], bool(text)))
    return rows


def empty_tail(raw: bytes) -> int:
    """How many tokens came after the last chunk with visible text."""
    rows = visible_counts(raw)
    last_visible = max((n for n, visible in rows if visible), default=0)
    return rows[-1][0] - last_visible if rows else 0


def held_back(raw: bytes, after: int = 80) -> tuple[int, int]:
    """(tokens, last) of the widest run of tokens the server held back (no chunk of their own:
    part of a UTF-8 character), ending with token `last` > after; (0, 0) when the first token's
    chunk brought more than one (the stream's start held back too: no TTFT to compare)."""
    rows = [(0, True)] + visible_counts(raw)
    if len(rows) < 3 or rows[2][0] != 1:  # rows[1] is the role chunk: 0 tokens
        return 0, 0
    pairs = zip(rows[2:], rows[3:], strict=False)
    gaps = [(b - a - 1, b - 1) for (a, _), (b, _) in pairs if b - 1 > after]
    return max(gaps, default=(0, 0))


def timed_stream(
    http: urllib3.PoolManager, base: str, body: dict
) -> tuple[bytes, list[float], dict[str, float]]:
    """One lone stream: its bytes, each event's arrival (s after sending), the server's truth."""
    before = scrape(http, base)
    data = json.dumps({**body, "stream": True, "stream_options": STREAM_OPTIONS})
    start = time.perf_counter()
    r = http.request(
        "POST",
        f"{base}/v1/chat/completions",
        body=data,
        headers={"Content-Type": "application/json"},
        preload_content=False,
    )
    raw, offsets, pending = b"", [], b""
    while chunk := r.read1(65536):
        now = time.perf_counter() - start
        pending += chunk
        while b"\n\n" in pending:
            event, pending = pending.split(b"\n\n", 1)
            raw += event + b"\n\n"
            offsets.append(now)
    r.release_conn()
    after = scrape(http, base)
    return raw, offsets, {key: after[name] - before[name] for key, name in TRUTH.items()}


def timed_decode(http: urllib3.PoolManager, base: str, model: str, out: Path, tries: int) -> None:
    """A bench-shaped stream that ends with tokens usage counts but no visible text, each
    event's arrival kept, with the server's truth for it: greedy decoding repeats itself, so a
    first stream shows where the server held tokens back, and the same request cut there
    (max_tokens) ends with a chunk that brings them and no text."""
    make = sweep_body(model, 32, 160)
    for i in range(tries):
        body = make(i)
        raw, _, _ = timed_stream(http, base, body)
        run, last = held_back(raw)
        print(f"try {i}: widest held-back run {run} tokens, ending at token {last}")
        if run < 3:
            continue
        cut = {**body, "max_tokens": last, "min_tokens": last}
        raw, offsets, truth = timed_stream(http, base, cut)
        print(
            f"  cut at {last}: empty tail {empty_tail(raw)}, last event {offsets[-1]:.4f} s,"
            f" truth {truth}"
        )
        if empty_tail(raw) >= 3 and held_back(raw, 0)[1]:
            break
    (out / "empty-tail.sse").write_bytes(raw)
    timed = {"offsets_s": [round(t, 6) for t in offsets], "server": truth}
    (out / "empty-tail.json").write_text(json.dumps(timed, indent=1) + "\n")


if __name__ == "__main__":
    main()
