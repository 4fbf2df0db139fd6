"""The server's own view: its load gauges (is it idle?) and its latency histograms.

vLLM and SGLang export Prometheus text at /metrics; the names below are theirs. A cell starts
only when the gauges show nothing running or waiting (without them it is refused: SGLang serves
/metrics only with --enable-metrics), and the histograms read before and after a cell give the
server's mean TTFT and inter-token latency for exactly that cell, beside the client's.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

import urllib3

from pipelines.core.httpjson import fetch

RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs")
WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")
# metric in our report -> the histogram each server keeps for it (the first one found is used).
HISTOGRAMS = {
    "ttft": ("vllm:time_to_first_token_seconds", "sglang:time_to_first_token_seconds"),
    "itl": (
        "vllm:inter_token_latency_seconds",
        "vllm:time_per_output_token_seconds",
        "sglang:inter_token_latency_seconds",
    ),
    "e2el": ("vllm:e2e_request_latency_seconds", "sglang:e2e_request_latency_seconds"),
}


@dataclass(frozen=True)
class Metrics:
    """One scrape: every sample's value by metric name (labels summed over), and each
    histogram's cumulative bucket counts by upper bound (labels other than `le` summed over)."""

    values: dict[str, float]
    buckets: dict[str, dict[float, float]] = field(default_factory=dict)

    def gauge(self, names: tuple[str, ...]) -> float | None:
        """The first of names the server exports, or None."""
        return next((self.values[n] for n in names if n in self.values), None)


def read_metrics(base_url: str) -> Metrics | None:
    """Scrape /metrics (None when the server has none or cannot be reached)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        status, page = fetch("GET", f"{base_url}/metrics", 10)
    except urllib3.exceptions.HTTPError:
        return None
    if status != 200:
        return None
    values: dict[str, float] = {}
    buckets: dict[str, dict[float, float]] = {}
    try:
        for family in text_string_to_metric_families(page.decode(errors="replace")):
            for sample in family.samples:
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
                if sample.name.endswith("_bucket") and "le" in sample.labels:
                    counts = buckets.setdefault(sample.name.removesuffix("_bucket"), {})
                    bound = float(sample.labels["le"])  # "+Inf" reads as inf
                    counts[bound] = counts.get(bound, 0.0) + sample.value
    except ValueError:  # not Prometheus text (a proxy's error page): no metrics to read
        return None
    return Metrics(values, buckets)


def load_of(metrics: Metrics | None) -> tuple[float, float] | None:
    """(running, waiting) requests, or None when the server exports neither gauge."""
    if metrics is None:
        return None
    running, waiting = metrics.gauge(RUNNING), metrics.gauge(WAITING)
    if running is None and waiting is None:
        return None
    return running or 0.0, waiting or 0.0


def not_serving(base_url: str, model: str | None = None) -> str | None:
    """Why base_url is no OpenAI server to measure (nothing answers, or /v1/models is not
    there: a URL ending in /v1, a wrong port), or does not serve model when one is named;
    None when /v1/models answers 200 (and lists model)."""
    try:
        status, page = fetch("GET", f"{base_url}/v1/models", 30)
    except urllib3.exceptions.HTTPError as err:
        reason = getattr(err, "reason", None) or err
        return f"nothing answers at {base_url}: {type(reason).__name__}: {str(reason)[:160]}"
    if status == 404:
        return (
            f"{base_url}/v1/models: HTTP 404: not an OpenAI-compatible server's root"
            " (give the URL without /v1)"
        )
    if status != 200:
        return f"{base_url}/v1/models: HTTP {status}"
    if model is None:
        return None
    try:
        cards = served_models(json.loads(page))
    except (ValueError, RecursionError):
        return f"{base_url}/v1/models: not JSON"
    if model not in cards:
        listed = ", ".join(sorted(cards)[:10]) or "none"
        return f"the server at {base_url} serves no model {model!r} (it lists: {listed})"
    return None


def served_models(body: Any) -> dict[str, dict[str, Any]]:
    """The model cards of a /v1/models answer by id (only ids that are strings: whatever else
    a server sent is no model of its)."""
    data = body.get("data") if isinstance(body, dict) else None
    cards = data if isinstance(data, list) else []
    return {c["id"]: c for c in cards if isinstance(c, dict) and isinstance(c.get("id"), str)}


def wait_until_idle(base_url: str, timeout: float = 30.0) -> str | None:
    """Wait for nothing running or waiting; None when idle, else why the cell must not start."""
    deadline = time.monotonic() + timeout
    while True:
        load = load_of(read_metrics(base_url))
        if load == (0.0, 0.0):
            return None
        if time.monotonic() > deadline:
            break
        # Unreadable load is retried too: one scrape may time out while warm-up drains.
        time.sleep(0.2)
    if load is None:
        return (
            f"cannot tell whether the server is idle: {base_url}/metrics has none of"
            f" {', '.join(RUNNING + WAITING)}"
        )
    return f"server busy: {load[0]:.0f} running, {load[1]:.0f} waiting after {timeout:.0f} s"


def histogram_means(before: Metrics | None, after: Metrics | None) -> dict[str, float | None]:
    """The server's mean of each histogram over what happened between two scrapes, in ms."""
    means: dict[str, float | None] = {}
    for metric, names in HISTOGRAMS.items():
        means[f"server_mean_{metric}_ms"] = None
        if before is None or after is None:
            continue
        for name in names:
            total, count = f"{name}_sum", f"{name}_count"
            if total in after.values and count in after.values:
                n = after.values[count] - before.values.get(count, 0.0)
                s = after.values[total] - before.values.get(total, 0.0)
                means[f"server_mean_{metric}_ms"] = s / n * 1000 if n > 0 else None
                break
    return means


def histogram_medians(before: Metrics | None, after: Metrics | None) -> dict[str, float | None]:
    """The server's median of each histogram over what happened between two scrapes, in ms,
    estimated from its buckets as Prometheus's histogram_quantile does (linear within the
    bucket the middle request fell in): as fine as the server's buckets, no finer."""
    medians: dict[str, float | None] = {}
    for metric, names in HISTOGRAMS.items():
        medians[f"server_median_{metric}_ms"] = None
        if before is None or after is None:
            continue
        name = next((n for n in names if n in after.buckets), None)
        if name is None:
            continue
        old = before.buckets.get(name, {})
        counts = sorted((b, c - old.get(b, 0.0)) for b, c in after.buckets[name].items())
        median = bucket_quantile(0.5, counts)
        medians[f"server_median_{metric}_ms"] = median * 1000 if median is not None else None
    return medians


def bucket_quantile(q: float, counts: list[tuple[float, float]]) -> float | None:
    """The q-quantile of cumulative bucket counts [(upper bound, count)], sorted by bound."""
    if not counts or counts[-1][1] <= 0:
        return None
    rank = q * counts[-1][1]
    lower, below = 0.0, 0.0
    for bound, cumulative in counts:
        if cumulative >= rank:
            if math.isinf(bound):  # above the highest finite bound: that bound is all we know
                return lower
            inside = cumulative - below
            return lower + (bound - lower) * ((rank - below) / inside if inside > 0 else 1.0)
        lower, below = bound, cumulative
    return None
