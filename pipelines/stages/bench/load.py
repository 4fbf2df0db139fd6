"""Closed-loop load: C streams, each sending its next request when its last one ends."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pipelines.stages.bench.client import stream_chat
from pipelines.stages.bench.failures import NotMeasured
from pipelines.stages.bench.record import RequestRecord
from pipelines.stages.bench.serverview import (
    histogram_means,
    histogram_medians,
    not_serving,
    read_metrics,
    wait_until_idle,
)
from pipelines.stages.bench.stall import StallWatch
from pipelines.stages.bench.timing import steady_state, summarize


@dataclass(frozen=True)
class CellSpec:
    """One measured cell: its name, concurrency, requests in all, and the request body maker."""

    name: str
    concurrency: int
    requests: int
    body: Callable[[int], dict[str, Any]]  # request index -> chat completion body
    timeout: float
    warmup: int = 1


@dataclass
class Cell:
    """A cell's outcome: the summary (vLLM keys), the raw records, or why it did not run."""

    name: str
    concurrency: int
    summary: dict[str, Any] = field(default_factory=dict)
    records: list[RequestRecord] = field(default_factory=list)
    refused: str | None = None
    repeats: list[dict[str, Any]] = field(default_factory=list)  # each run's summary

    def as_json(self) -> dict[str, Any]:
        """The cell for the run's JSON, raw per-request timings kept."""
        return {
            "name": self.name,
            "concurrency": self.concurrency,
            "refused": self.refused,
            "summary": self.summary,
            "repeats": self.repeats,
            "requests": [r.as_json() for r in self.records],
        }


def run_closed_loop(base_url: str, spec: CellSpec) -> tuple[list[RequestRecord], float]:
    """Send spec.requests requests over spec.concurrency streams; records and wall seconds.

    Every body is made before the clock starts (a body may ask the server to count its
    prompt), so the first wave leaves together, as a server under C users sees it, and each
    next request as its stream's last one ends. (A barrier before the first wave made it no
    narrower in tests/test_bench.py: making each body was what spread it.)
    """
    bodies = [spec.body(index) for index in range(spec.requests)]
    records: list[RequestRecord | None] = [None] * spec.requests
    next_index = iter(range(spec.requests))
    lock = threading.Lock()

    def stream() -> None:
        while True:
            with lock:
                index = next(next_index, None)
            if index is None:
                return
            records[index] = stream_chat(base_url, bodies[index], spec.timeout)

    started = time.perf_counter()
    streams = min(spec.concurrency, spec.requests)
    threads = [threading.Thread(target=stream, daemon=True) for _ in range(streams)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [r for r in records if r is not None], time.perf_counter() - started


def start_spread_ms(records: list[RequestRecord], concurrency: int) -> float | None:
    """How far apart the first wave's requests started, in ms (None with no wave)."""
    wave = sorted(r.started for r in records)[:concurrency]
    return round((wave[-1] - wave[0]) * 1000, 3) if wave else None


def short(body: dict[str, Any], tokens: int = 8) -> dict[str, Any]:
    """The same request asking for only a few tokens."""
    return {**body, "max_tokens": tokens, "min_tokens": min(tokens, body.get("min_tokens", 0))}


def run_cell(base_url: str, spec: CellSpec, idle_timeout: float = 30.0) -> Cell:
    """Warm up, wait for an idle server, then measure one cell with the server's view beside."""
    cell = Cell(spec.name, spec.concurrency)
    # Before any warm-up or idle wait: a wrong URL is said at once, not blamed on /metrics.
    if why := not_serving(base_url):
        cell.refused = why
        return cell
    if spec.warmup:
        # Short requests on every stream, dropped: the server warms up and each stream's
        # kept-alive connection is open, so no measured request pays for a connect.
        warm = CellSpec(
            "warmup",
            spec.concurrency,
            spec.concurrency * spec.warmup,
            lambda i: short(spec.body(-1 - i)),
            spec.timeout,
            0,
        )
        try:
            run_closed_loop(base_url, warm)
        except NotMeasured as err:  # a prompt the server's count cannot be fitted to
            cell.refused = str(err)
            return cell
    busy = wait_until_idle(base_url, idle_timeout)
    if busy:
        cell.refused = busy
        return cell
    before = read_metrics(base_url)
    try:
        with StallWatch() as watch:
            cell.records, duration = run_closed_loop(base_url, spec)
    except NotMeasured as err:
        cell.refused = str(err)
        return cell
    after = read_metrics(base_url)
    cell.summary = {
        "concurrency": spec.concurrency,
        **summarize(cell.records, duration),
        "start_spread_ms": start_spread_ms(cell.records, spec.concurrency),
        "client_stall_s": round(watch.worst, 3),
        **steady_state(cell.records, spec.concurrency),
        **histogram_means(before, after),
        **histogram_medians(before, after),
    }
    return cell


# Summary keys that add up over runs, and those whose worst run is the cell's; the other
# numbers are averaged.
SUMMED = ("completed", "failed", "total_input_tokens", "total_output_tokens", "duration")
WORST = ("start_spread_ms", "client_stall_s")


def merged_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One summary of a cell's runs: counts added, figures averaged (mean of the runs' means,
    medians and percentiles), the rest from the first run that has it; errors counted over all."""
    merged: dict[str, Any] = {"repeats": len(runs)}
    for key in dict.fromkeys(k for run in runs for k in run):
        values = [run.get(key) for run in runs]
        numbers = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if key in SUMMED:
            merged[key] = sum(numbers)
        elif key in WORST and numbers:
            merged[key] = max(numbers)
        elif numbers and len(numbers) == len(values) and len(set(numbers)) == 1:
            merged[key] = numbers[0]  # the same in every run (concurrency): kept as it is
        elif numbers and len(numbers) == len(values):
            merged[key] = sum(numbers) / len(numbers)
        else:
            merged[key] = next((v for v in values if v is not None), None)
    counts: dict[str, int] = {}
    for run in runs:
        for error in run.get("errors") or []:
            counts[error["reason"]] = counts.get(error["reason"], 0) + error["count"]
    merged["errors"] = [{"reason": r, "count": n} for r, n in sorted(counts.items(),
                        key=lambda item: -item[1])][:5]  # fmt: skip
    return merged


def run_repeated(base_url: str, spec: CellSpec, repeats: int, idle_timeout: float = 30.0) -> Cell:
    """The cell run `repeats` times (warm-up and idle check before each): each run's summary
    kept for the gate's intervals, their merge as the cell's summary, every record kept."""
    cell = Cell(spec.name, spec.concurrency)
    for _ in range(repeats):
        run = run_cell(base_url, spec, idle_timeout)
        if run.refused:
            cell.refused = run.refused
            break
        cell.records += run.records
        cell.repeats.append(run.summary)
    if cell.repeats:
        cell.summary = merged_summary(cell.repeats)
    return cell
