"""The regression gate: each baseline metric of the profile against what the run measured.

A cell runs R times; each gated metric gets a bootstrap 95% interval of its mean over the runs.
The whole interval beyond the tolerance is `regressed`, the whole interval within it `passed`,
an interval across the limit `inconclusive`, with about how many more runs would decide. With
one run the interval is that one value: the gate compares it as a single number.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from pipelines.core.profiles import BaselineSpec
from pipelines.stages.bench.intervals import bootstrap_interval, runs_to_decide
from pipelines.stages.bench.stall import stall_note

PASSED, REGRESSED, INCONCLUSIVE, NOT_MEASURED = (
    "passed",
    "regressed",
    "inconclusive",
    "not measured",
)


def cell_samples(cell: dict[str, Any] | None, key: str) -> list[float]:
    """A cell's value of key in each of its runs (empty when any run lacks it)."""
    if not cell:
        return []
    runs = cell.get("repeats") or [cell.get("summary") or {}]
    values = [run.get(key) for run in runs]
    if not values or not all(isinstance(v, (int, float)) for v in values):
        return []
    return [float(v) for v in values]


def metric_samples(results: dict[str, Any], metric: str) -> list[float]:
    """A metric's value in each run, by its dotted name: decode.c8.median_window_tok_s,
    saturation.output_throughput, needles.correct (one value: the fraction answered)."""
    section, _, rest = metric.partition(".")
    if section == "decode":
        cell_name, _, key = rest.partition(".")
        cells = {c["name"]: c for c in results.get("decode", [])}
        return cell_samples(cells.get(cell_name), key)
    if section == "saturation":
        return cell_samples(results.get("saturation"), rest)
    if section == "needles" and rest == "correct":
        needles = results.get("needles", [])
        return [sum(n["correct"] for n in needles) / len(needles)] if needles else []
    return []


def metric_value(results: dict[str, Any], metric: str) -> float | None:
    """A metric's mean over the runs, or None when it was not measured."""
    samples = metric_samples(results, metric)
    return statistics.fmean(samples) if samples else None


@dataclass(frozen=True)
class Judgement:
    """One gated metric's verdict, what it rests on, and the line that says it."""

    verdict: str
    measured: float | None
    interval: tuple[float, float] | None
    runs: int
    line: str | None  # None when passed


def judge(results: dict[str, Any], entry: BaselineSpec) -> Judgement:
    """The verdict on one baseline metric from its interval over the runs."""
    samples = metric_samples(results, entry.metric)
    if not samples:
        return Judgement(NOT_MEASURED, None, None, 0, f"{entry.metric}: not measured"
                         f" (baseline {entry.value:g})")  # fmt: skip
    mean, interval, runs = statistics.fmean(samples), bootstrap_interval(samples), len(samples)
    higher = entry.better == "higher"

    def worse(value: float) -> float:
        return (entry.value - value) / entry.value * (1 if higher else -1)

    best, worst = (interval[1], interval[0]) if higher else interval
    change = (mean - entry.value) / entry.value
    direction = "lower" if higher else "higher"
    said = (
        f"{entry.metric}: {mean:.4g} against baseline {entry.value:g}"
        f" ({change:+.1%}; tolerance {entry.tolerance:.0%} {direction})"
    )
    spread = f"95% interval {interval[0]:.4g}..{interval[1]:.4g} over {runs} runs"
    if worse(best) > entry.tolerance:
        return Judgement(
            REGRESSED, mean, interval, runs, said + (f"; {spread}" if runs > 1 else "")
        )
    if worse(worst) <= entry.tolerance:
        return Judgement(PASSED, mean, interval, runs, None)
    limit = entry.value * (1 - entry.tolerance if higher else 1 + entry.tolerance)
    more = runs_to_decide(mean, interval, limit, runs)
    decide = (
        f"about {more} more run{'s' if more != 1 else ''} would decide"
        if more > 0
        else "its mean sits on the limit: more runs may not decide"
    )
    line = f"{said}: inconclusive: the {spread} spans the limit {limit:.4g}; {decide}"
    return Judgement(INCONCLUSIVE, mean, interval, runs, line)


def check_baseline(results: dict[str, Any], baseline: list[BaselineSpec]) -> list[str]:
    """One line per metric regressed or not measured (metric, measured, baseline, by how
    much); empty when none is."""
    judged = (judge(results, entry) for entry in baseline)
    return [j.line for j in judged if j.verdict in (REGRESSED, NOT_MEASURED) and j.line]


def inconclusive(results: dict[str, Any], baseline: list[BaselineSpec]) -> list[str]:
    """One line per metric whose interval spans its limit, with the runs that would decide."""
    judged = (judge(results, entry) for entry in baseline)
    return [j.line for j in judged if j.verdict == INCONCLUSIVE and j.line]


def regressed(results: dict[str, Any], baseline: list[BaselineSpec]) -> bool:
    """True when a metric's whole interval is worse than its baseline's tolerance allows."""
    return any(judge(results, entry).verdict == REGRESSED for entry in baseline)


def measured_all(results: dict[str, Any], baseline: list[BaselineSpec]) -> bool:
    """True when the server answered, every cell ran whole with a client that kept up, and
    every gated metric has a value: only then is the gate a verdict on the deployment rather
    than on the measurement."""
    probes = results.get("probes") or []
    cells = list(results.get("decode", [])) + [c for c in [results.get("saturation")] if c]
    return (
        bool(probes)
        and probes[0]["passed"]  # the models probe: the server answers and serves the model
        and not any(
            c.get("refused")
            or (c.get("summary") or {}).get("failed")
            or stall_note(c.get("summary") or {})
            for c in cells
        )
        and all(metric_value(results, entry.metric) is not None for entry in baseline)
    )


def gate_rows(results: dict[str, Any], baseline: list[BaselineSpec]) -> list[dict[str, Any]]:
    """Every baseline metric with its measured mean, interval, change and verdict."""
    rows = []
    for entry in baseline:
        j = judge(results, entry)
        rows.append(
            {
                "metric": entry.metric,
                "baseline": entry.value,
                "measured": j.measured,
                "interval": list(j.interval) if j.interval else None,
                "runs": j.runs,
                "change": (j.measured - entry.value) / entry.value
                if j.measured is not None
                else None,
                "tolerance": entry.tolerance,
                "better": entry.better,
                "verdict": j.verdict,
            }
        )
    return rows
