"""Correctness probes: the server serves the right model, answers, thinks, calls tools, scales."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

import urllib3

from pipelines.core.httpjson import get_json
from pipelines.stages.bench.client import stream_chat
from pipelines.stages.bench.serverview import served_models

WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city's name."}},
            "required": ["city"],
        },
    },
}


@dataclass(frozen=True)
class Probe:
    """One probe's verdict and what it saw."""

    name: str
    passed: bool
    detail: str

    def as_json(self) -> dict[str, Any]:
        """The probe for the run's JSON."""
        return asdict(self)


def chat(
    model: str, prompt: str, max_tokens: int, thinking: bool = False, **extra: Any
) -> dict[str, Any]:
    """A greedy chat completion body with thinking set explicitly (both template spellings)."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "chat_template_kwargs": {"thinking": thinking, "enable_thinking": thinking},
        **extra,
    }


def probe_models(base_url: str, model: str, min_context: int) -> tuple[Probe, int | None]:
    """/v1/models lists the served name with at least the profile's context; and that context."""
    try:
        status, body = get_json(f"{base_url}/v1/models")
    except urllib3.exceptions.HTTPError as err:
        return Probe("models", False, f"unreachable: {type(err).__name__}"), None
    cards = served_models(body)
    if status != 200 or model not in cards:
        return Probe("models", False, f"HTTP {status}; served: {sorted(cards)}"), None
    context = cards[model].get("max_model_len")
    passed = context is None or context >= min_context
    return Probe("models", passed, f"{model}, max_model_len {context}"), context


def probe_arithmetic(base_url: str, model: str, timeout: float) -> Probe:
    """'19+23' with thinking off answers 42 and stops on its own."""
    r = stream_chat(
        base_url, chat(model, "What is 19+23? Answer with the number only.", 64), timeout
    )
    passed = r.ok and "42" in r.content and r.finish_reason == "stop"
    seen = r.error or f"content {r.content.strip()[:40]!r}, finish {r.finish_reason}"
    return Probe("arithmetic", passed, seen)


def probe_thinking(base_url: str, model: str, timeout: float) -> Probe:
    """With thinking on, the answer comes after reasoning tokens (usage counts them)."""
    body = chat(model, "What is 19+23? Think first.", 512, thinking=True)
    r = stream_chat(base_url, body, timeout)
    reasoning = r.reasoning_tokens or 0
    passed = r.ok and (reasoning > 0 or bool(r.reasoning))
    seen = r.error or f"reasoning_tokens {r.reasoning_tokens}, reasoning {len(r.reasoning)} chars"
    if r.ok and not passed:
        # The usual cause: no reasoning parser, so the thinking stays in the content (or the
        # template ignores the thinking switch and none comes).
        inline = "</think>" in r.content or "<think>" in r.content
        seen += (
            "; the thinking came inside the content (<think>...</think>): the server has no"
            " reasoning parser (vLLM --reasoning-parser, SGLang --reasoning-parser)"
            if inline
            else "; no reasoning at all: does the server run a reasoning parser, and does the"
            " chat template honour thinking/enable_thinking?"
        )
    return Probe("thinking", passed, seen)


def probe_tool_call(base_url: str, model: str, timeout: float) -> Probe:
    """Asked for the weather with a weather tool, the model calls it with JSON arguments."""
    body = chat(model, "Use get_weather: what is the weather in Paris?", 256, tools=[WEATHER_TOOL])
    body["tool_choice"] = "auto"
    r = stream_chat(base_url, body, timeout)
    if not r.ok:
        return Probe("tool_call", False, r.error or "")
    name = "".join((c.get("function") or {}).get("name") or "" for c in r.tool_calls)
    arguments = "".join((c.get("function") or {}).get("arguments") or "" for c in r.tool_calls)
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return Probe("tool_call", False, f"function {name!r}, arguments not JSON: {arguments!r}")
    if not isinstance(parsed, dict):
        return Probe("tool_call", False, f"function {name!r}, arguments not an object")
    # A real vLLM forced into this call answered `{}`: a call, but not one the tool can run.
    missing = [k for k in WEATHER_TOOL["function"]["parameters"]["required"] if k not in parsed]
    passed = name == "get_weather" and not missing
    seen = f"function {name!r}, arguments {arguments[:80]}"
    return Probe("tool_call", passed, seen + (f"; missing {', '.join(missing)}" if missing else ""))


def probe_concurrent(base_url: str, model: str, timeout: float, streams: int = 8) -> Probe:
    """streams requests at once: every one HTTP 200 and complete."""
    body = chat(model, "Count slowly.", 32)
    with ThreadPoolExecutor(streams) as pool:
        results = list(pool.map(lambda _: stream_chat(base_url, body, timeout), range(streams)))
    bad = [r.error or f"HTTP {r.status}" for r in results if not r.ok or r.status != 200]
    detail = f"{streams - len(bad)}/{streams} HTTP 200" + (f"; {bad[0]}" if bad else "")
    return Probe(f"concurrent_{streams}", not bad, detail)


def run_probes(base_url: str, model: str, min_context: int, timeout: float) -> list[Probe]:
    """Every probe, in order; after a failed /v1/models the others are not tried."""
    models, _ = probe_models(base_url, model, min_context)
    if not models.passed:
        return [models]
    return [
        models,
        probe_arithmetic(base_url, model, timeout),
        probe_thinking(base_url, model, timeout),
        probe_tool_call(base_url, model, timeout),
        probe_concurrent(base_url, model, timeout),
    ]
