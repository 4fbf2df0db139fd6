"""One benchmark run: probes, the decode sweep, saturation and needles, with a line per cell."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from typing import Any

from pipelines.core import progress
from pipelines.core.profiles import BaselineSpec, BenchSpec
from pipelines.stages.bench.failures import NotMeasured
from pipelines.stages.bench.gate import check_baseline, gate_rows, inconclusive
from pipelines.stages.bench.load import Cell, CellSpec, run_repeated
from pipelines.stages.bench.needles import FILLER, fit_to_length, run_needle, server_counter
from pipelines.stages.bench.probes import run_probes
from pipelines.stages.bench.stall import stall_note
from pipelines.stages.bench.timing import failure_reasons

CODE_TASK = (
    "Write a complete Python module that implements a thread-safe LRU cache with time-based "
    "expiry, with docstrings and unit tests. Output only code."
)


def sweep_message(words: int, nonce: str, pad: int = 0) -> str:
    """The sweep's prompt: a nonce, `words` filler words, `pad` single dots, then the task."""
    filler = FILLER.split()
    context = " ".join(filler[i % len(filler)] for i in range(words))
    return f"[{nonce}] {context}{' .' * pad}\n\n{CODE_TASK}"


# Counts asked per request to land exactly on its length: a few are enough where a dot is one
# token (a nonce moves the count by a token or two, each dot by one).
EXACT_TRIES = 6


def exact_message(target: int, words: int, count: Callable[[str], int]) -> str:
    """A sweep prompt of a fresh nonce that the server counts as exactly target tokens: the
    fitted words (fewer if this nonce costs more), then dots up to the length."""
    tag, pad, seen = nonce(), 0, []
    for _ in range(EXACT_TRIES):
        message = sweep_message(words, tag, pad)
        tokens = count(message)
        if tokens == target:
            return message
        seen.append(tokens)
        if tokens > target and pad == 0:
            words = max(0, words - (tokens - target))  # each filler word is a token or more
        else:
            pad = max(0, pad + target - tokens)
    raise NotMeasured(
        f"--prompt-tokens {target}: the server counted {', '.join(map(str, seen))} tokens for"
        f" prompts fitted to it, never {target} (its tokenizer does not count a dot as one)"
    )


def sweep_body(
    model: str, prompt_tokens: int, max_tokens: int, count: Callable[[str], int] | None = None
) -> Callable[[int], dict[str, Any]]:
    """Greedy code generation, thinking off, exactly max_tokens out; a fresh nonce per request.

    With count (the server's own token count of a prompt) each prompt is exactly prompt_tokens
    tokens by that count; without it, prompt_tokens words in all (an estimate).
    """
    if count is None:
        words = max(0, prompt_tokens - len(CODE_TASK.split()) - 1)  # - the task, the nonce
    else:
        words = fit_to_length(prompt_tokens, count, lambda n: sweep_message(n, nonce()))

    def message() -> str:
        if count is None:
            return sweep_message(words, nonce())
        return exact_message(prompt_tokens, words, count)

    def body(index: int) -> dict[str, Any]:
        return {
            "model": model,
            "messages": [{"role": "user", "content": message()}],
            "max_tokens": max_tokens,
            "min_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": 0,
            "chat_template_kwargs": {"thinking": False, "enable_thinking": False},
        }

    return body


def nonce() -> str:
    """16 hex digits, always the same length: no prefix cache hit between requests."""
    return secrets.token_hex(8)


def fitted_sweep_body(
    base_url: str, model: str, prompt_tokens: int, max_tokens: int, timeout: float
) -> Callable[[int], dict[str, Any]]:
    """The sweep body with each prompt exactly prompt_tokens by the server's own count."""
    counter = server_counter(base_url, model, timeout)

    def count(prompt: str) -> int:
        try:
            return counter(prompt)
        except RuntimeError as err:
            raise NotMeasured(f"--prompt-tokens {prompt_tokens}: {err}") from err

    return sweep_body(model, prompt_tokens, max_tokens, count)


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
    if s.get("window_note"):
        parts.append(s["window_note"])
    if s.get("median_ttft_ms") is not None:
        parts.append(f"TTFT median {s['median_ttft_ms']:.0f} ms")
    if note := stall_note(s):
        parts.append(note)
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
    try:
        body = fitted_sweep_body(base_url, model, bench.prompt_tokens, bench.max_tokens, timeout)
    except NotMeasured as err:
        results["failures"].append(f"decode: {err}")
        return results
    for c in bench.concurrency:
        spec = CellSpec(f"c{c}", c, c * bench.requests_per_stream, body, timeout)
        say(
            f"decode c{c}: {spec.requests} requests x {bench.max_tokens} tokens, {c} streams,"
            f" {bench.repeats} run(s)"
        )
        cell = run_repeated(base_url, spec, bench.repeats)
        results["decode"].append(cell.as_json())
        say(cell_line(cell))
    n, tokens = bench.saturation_streams, bench.saturation_tokens
    say(f"saturation: {n} streams x {tokens} tokens")
    saturating = fitted_sweep_body(base_url, model, bench.prompt_tokens, tokens, timeout)
    spec = CellSpec("saturation", n, n, saturating, timeout)
    cell = run_repeated(base_url, spec, bench.repeats)
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
        elif note := stall_note(cell["summary"]):
            results["failures"].append(f"cell {cell['name']}: {note}")
    return results


def gate(results: dict[str, Any], baseline: list[BaselineSpec]) -> dict[str, Any]:
    """Add the gate to the results: its rows, its failures and the metrics it cannot decide
    yet (write_results sets the verdict)."""
    results["gate"] = gate_rows(results, baseline)
    results["failures"] += check_baseline(results, baseline)
    results["inconclusive"] = inconclusive(results, baseline)
    results["finished"] = time.time()
    return results
