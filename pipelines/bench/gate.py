"""The regression gate: each baseline metric of the profile against what the run measured."""

from __future__ import annotations

from typing import Any

from pipelines.profiles import BaselineSpec


def metric_value(results: dict[str, Any], metric: str) -> float | None:
    """A metric by its dotted name: decode.c8.median_window_tok_s, saturation.output_throughput."""
    section, _, rest = metric.partition(".")
    if section == "decode":
        cell_name, _, key = rest.partition(".")
        cells = {c["name"]: c for c in results.get("decode", [])}
        value = cells.get(cell_name, {}).get("summary", {}).get(key)
    elif section == "saturation":
        value = (results.get("saturation") or {}).get("summary", {}).get(rest)
    elif section == "needles" and rest == "correct":
        needles = results.get("needles", [])
        value = sum(n["correct"] for n in needles) / len(needles) if needles else None
    else:
        value = None
    return float(value) if isinstance(value, (int, float)) else None


def entry_failure(results: dict[str, Any], entry: BaselineSpec) -> str | None:
    """The gate's line for one baseline metric (not measured, or regressed); None when it holds."""
    measured = metric_value(results, entry.metric)
    if measured is None:
        return f"{entry.metric}: not measured (baseline {entry.value:g})"
    change = (measured - entry.value) / entry.value
    worse = -change if entry.better == "higher" else change
    if worse <= entry.tolerance:
        return None
    direction = "lower" if entry.better == "higher" else "higher"
    return (
        f"{entry.metric}: {measured:.4g} against baseline {entry.value:g}"
        f" ({change:+.1%}; tolerance {entry.tolerance:.0%} {direction})"
    )


def check_baseline(results: dict[str, Any], baseline: list[BaselineSpec]) -> list[str]:
    """One line per regression (metric, measured, baseline, by how much); empty when it passes."""
    return [line for entry in baseline if (line := entry_failure(results, entry))]


def regressed(results: dict[str, Any], baseline: list[BaselineSpec]) -> bool:
    """True when a metric the run measured is worse than its baseline's tolerance allows."""
    return any(
        metric_value(results, entry.metric) is not None and entry_failure(results, entry)
        for entry in baseline
    )


def measured_all(results: dict[str, Any], baseline: list[BaselineSpec]) -> bool:
    """True when the server answered, every cell ran whole and every gated metric has a value:
    only then is the gate a verdict on the deployment rather than on the measurement."""
    probes = results.get("probes") or []
    cells = list(results.get("decode", [])) + [c for c in [results.get("saturation")] if c]
    return (
        bool(probes)
        and probes[0]["passed"]  # the models probe: the server answers and serves the model
        and not any(c.get("refused") or (c.get("summary") or {}).get("failed") for c in cells)
        and all(metric_value(results, entry.metric) is not None for entry in baseline)
    )


def gate_rows(results: dict[str, Any], baseline: list[BaselineSpec]) -> list[dict[str, Any]]:
    """Every baseline metric with its measured value and change, for the report."""
    rows = []
    for entry in baseline:
        measured = metric_value(results, entry.metric)
        change = (measured - entry.value) / entry.value if measured is not None else None
        rows.append(
            {
                "metric": entry.metric,
                "baseline": entry.value,
                "measured": measured,
                "change": change,
                "tolerance": entry.tolerance,
                "better": entry.better,
            }
        )
    return rows
