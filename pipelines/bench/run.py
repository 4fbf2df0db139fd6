"""One benchmark run: probes, the decode sweep, saturation and needles, with a line per cell."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from typing import Any

from pipelines import progress
from pipelines.bench.gate import check_baseline, gate_rows
from pipelines.bench.load import Cell, CellSpec, run_cell
from pipelines.bench.needles import FILLER, run_needle
from pipelines.bench.probes import run_probes
from pipelines.bench.timing import failure_reasons
from pipelines.profiles import BaselineSpec, BenchSpec

CODE_TASK = (
    "Write a complete Python module that implements a thread-safe LRU cache with time-based "
    "expiry, with docstrings and unit tests. Output only code."
)


def sweep_body(model: str, prompt_tokens: int, max_tokens: int) -> Callable[[int], dict[str, Any]]:
    """Greedy code generation, thinking off, exactly max_tokens out; a fresh nonce per request."""
    # prompt_tokens words in all (the exact count is the server's, recorded from usage).
    words, fixed = FILLER.split(), len(CODE_TASK.split()) + 1  # + the nonce
    context = " ".join(words[i % len(words)] for i in range(max(0, prompt_tokens - fixed)))

    def body(index: int) -> dict[str, Any]:
        nonce = secrets.token_hex(8)  # no prefix cache hit between requests
        return {
            "model": model,
            "messages": [{"role": "user", "content": f"[{nonce}] {context}\n\n{CODE_TASK}"}],
            "max_tokens": max_tokens,
            "min_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": 0,
            "chat_template_kwargs": {"thinking": False, "enable_thinking": False},
        }

    return body


def say(line: str) -> None:
    """A progress line (plain: it reads the same on a terminal and in CI's log)."""
    progress.say("bench", line)


def cell_line(cell: Cell) -> str:
    """One line about a finished cell."""
    if cell.refused:
        return f"{cell.name}: refused ({cell.refused})"
    s = cell.summary
    failed = f": {failure_reasons(s)}" if s["failed"] else ""
    parts = [
        f"{s['completed']} ok, {s['failed']} failed{failed}",
        f"{s['output_throughput'] or 0:.1f} tok/s aggregate",
    ]
    if s.get("median_window_tok_s") is not None:
        parts.append(f"window {s['median_window_tok_s']:.2f} tok/s per stream")
    if s.get("median_ttft_ms") is not None:
        parts.append(f"TTFT median {s['median_ttft_ms']:.0f} ms")
    return f"{cell.name}: " + "; ".join(parts)


def run_bench(
    base_url: str, model: str, min_context: int, bench: BenchSpec, provenance: dict[str, Any]
) -> dict[str, Any]:
    """Measure everything the profile's bench section asks; the results dict (not yet gated)."""
    timeout = bench.request_timeout_s
    results: dict[str, Any] = {"schema": 1, "provenance": provenance, "failures": []}
    say(f"probes against {base_url} ({model})")
    probes = run_probes(base_url, model, min_context, timeout)
    results["probes"] = [p.as_json() for p in probes]
    for p in probes:
        say(f"probe {p.name}: {'ok' if p.passed else 'FAILED'} ({p.detail})")
        if not p.passed:
            results["failures"].append(f"probe {p.name}: {p.detail}")
    results["decode"], results["saturation"], results["needles"] = [], None, []
    if not probes[0].passed:
        return results
    body = sweep_body(model, bench.prompt_tokens, bench.max_tokens)
    for c in bench.concurrency:
        spec = CellSpec(f"c{c}", c, c * bench.requests_per_stream, body, timeout)
        say(f"decode c{c}: {spec.requests} requests x {bench.max_tokens} tokens, {c} streams")
        cell = run_cell(base_url, spec)
        results["decode"].append(cell.as_json())
        say(cell_line(cell))
    n, tokens = bench.saturation_streams, bench.saturation_tokens
    say(f"saturation: {n} streams x {tokens} tokens")
    spec = CellSpec("saturation", n, n, sweep_body(model, bench.prompt_tokens, tokens), timeout)
    cell = run_cell(base_url, spec)
    results["saturation"] = cell.as_json()
    say(cell_line(cell))
    for i, target in enumerate(bench.needles):
        say(f"needle at {target} tokens")
        needle = run_needle(base_url, model, target, 0.5, bench.needle_seconds_per_1k, seed=i)
        results["needles"].append(needle.as_json())
        verdict = "correct" if needle.correct else f"WRONG ({needle.error or 'answer differs'})"
        say(f"needle {needle.prompt_tokens} tokens: {verdict} in {needle.seconds or 0:.1f} s")
    for cell in results["decode"] + [results["saturation"]]:
        if cell.get("refused"):
            results["failures"].append(f"cell {cell['name']}: refused: {cell['refused']}")
        elif cell["summary"].get("failed"):
            errors = failure_reasons(cell["summary"])
            results["failures"].append(
                f"cell {cell['name']}: {cell['summary']['failed']} request(s) failed: {errors}"
            )
    return results


def gate(results: dict[str, Any], baseline: list[BaselineSpec]) -> dict[str, Any]:
    """Add the gate to the results: its rows and its failures (write_results sets the verdict)."""
    results["gate"] = gate_rows(results, baseline)
    results["failures"] += check_baseline(results, baseline)
    results["finished"] = time.time()
    return results
