"""The regression gate: each baseline metric of the profile against what the run measured."""

from __future__ import annotations

from typing import Any


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


def check_baseline(results: dict[str, Any], baseline: list[Any]) -> list[str]:
    """One line per regression (metric, measured, baseline, by how much); empty when it passes."""
    failures = []
    for entry in baseline:
        measured = metric_value(results, entry.metric)
        if measured is None:
            failures.append(f"{entry.metric}: not measured (baseline {entry.value:g})")
            continue
        change = (measured - entry.value) / entry.value
        worse = -change if entry.better == "higher" else change
        if worse > entry.tolerance:
            direction = "lower" if entry.better == "higher" else "higher"
            failures.append(
                f"{entry.metric}: {measured:.4g} against baseline {entry.value:g}"
                f" ({change:+.1%}; tolerance {entry.tolerance:.0%} {direction})"
            )
    return failures


def gate_rows(results: dict[str, Any], baseline: list[Any]) -> list[dict[str, Any]]:
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
