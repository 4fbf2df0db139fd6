"""Long-context needles: a RULER-style fact at a chosen depth in a haystack of a chosen length.

The length is the server's count, not a guess: `/tokenize` (vLLM) or, failing that, the
prompt_tokens of a one-token probe; the haystack is binary-searched to the target. A fresh
nonce opens every prompt sent, probes and the measured one alike, so that no prefix cache
makes one cheap: not within a run, not across runs.
"""

from __future__ import annotations

import json
import random
import secrets
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from pipelines.core.httpjson import post_json
from pipelines.stages.bench.client import MAX_PROMPT_TOKENS, stream_chat

FILLER = (
    "The grass is green and the sky is blue; the sun is yellow and here we go again. "
    "Rivers run to the sea while the hills stand still in the quiet of the afternoon. "
)
NEEDLE = "One of the special magic numbers for {key} is: {value}."
QUESTION = (
    "What is the special magic number for {key} mentioned in the text above?"
    " Answer with the number only."
)


@dataclass(frozen=True)
class NeedleResult:
    """One needle: asked length, measured length, outcome, and how long it took."""

    target_tokens: int
    prompt_tokens: int | None
    depth: float
    correct: bool
    seconds: float | None
    ttft_s: float | None
    error: str | None

    def as_json(self) -> dict[str, Any]:
        """The needle for the run's JSON."""
        return asdict(self)


def needle_prompt(filler_units: int, key: str, value: str, nonce: str, depth: float) -> str:
    """The prompt: nonce, filler with the needle at depth (0..1), then the question."""
    units = [FILLER] * filler_units
    units.insert(round(depth * filler_units), NEEDLE.format(key=key, value=value) + " ")
    return f"[{nonce}] " + "".join(units) + "\n\n" + QUESTION.format(key=key)


def server_counter(base_url: str, model: str, timeout: float) -> Callable[[str], int]:
    """Counts a prompt's tokens as the server does: /tokenize, else a max_tokens=1 probe."""

    def count(prompt: str) -> int:
        messages = [{"role": "user", "content": prompt}]
        status, body = post_json(
            f"{base_url}/tokenize", {"model": model, "messages": messages}, timeout
        )
        if status == 200 and isinstance(body, dict) and "count" in body:
            told = body["count"]
            if type(told) is not int or not 0 <= told <= MAX_PROMPT_TOKENS:
                shown = json.dumps(told)[:40]
                raise RuntimeError(f"/tokenize answered count {shown}: expected a whole number"
                                   f" from 0 to {MAX_PROMPT_TOKENS}")  # fmt: skip
            return told
        probe = {"model": model, "messages": messages, "max_tokens": 1}
        record = stream_chat(base_url, probe, timeout)
        if record.prompt_tokens is None:
            raise RuntimeError(f"cannot count tokens: /tokenize HTTP {status}; {record.error}")
        return record.prompt_tokens

    return count


def fit_to_length(target: int, count: Callable[[str], int], build: Callable[[int], str]) -> int:
    """The most filler units whose prompt stays within target tokens (binary search)."""
    one = count(build(1))
    per_unit = max(1, count(build(2)) - one)
    low, high = 0, max(2, 2 * (target // per_unit + 2))
    while high - low > 1:  # invariant: build(low) fits, build(high) does not (or is the bound)
        mid = (low + high) // 2
        if count(build(mid)) <= target:
            low = mid
        else:
            high = mid
    return low


def run_needle(
    base_url: str, model: str, target: int, depth: float, seconds_per_1k: float, seed: int
) -> NeedleResult:
    """Build, fit and ask one needle; the answer is scored by exact match of the value."""
    rng = random.Random(seed)
    key, value = f"needle-{rng.randrange(10**6):06d}", f"{rng.randrange(10**6, 10**7)}"
    timeout = 60 + seconds_per_1k * target / 1000  # minutes to hours at 100k+ tokens

    def build(units: int) -> str:
        # Every call its own nonce (16 hex digits, always the same length): a probe must not
        # warm the prefix cache for the measured prompt, nor an earlier run for this one.
        return needle_prompt(units, key, value, secrets.token_hex(8), depth)

    try:
        # Probes prefill as much as the measured request: they get its timeout.
        count = server_counter(base_url, model, timeout)
        units = fit_to_length(target, count, build)
    except Exception as err:  # noqa: BLE001 - any failure to build the prompt fails this needle
        return NeedleResult(target, None, depth, False, None, None, f"build: {err}")
    prompt = build(units)
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 64,
        "temperature": 0,
        "chat_template_kwargs": {"thinking": False, "enable_thinking": False},
    }
    started = time.perf_counter()
    record = stream_chat(base_url, body, timeout)
    seconds = time.perf_counter() - started
    first = next((e.t for e in record.events if e.carries), None)
    correct = record.ok and value in record.content
    # The length is the measured request's own usage: counting it again would send it twice.
    return NeedleResult(target, record.prompt_tokens, depth, correct, seconds, first, record.error)
