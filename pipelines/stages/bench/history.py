"""Bench runs across deployments: each run's index entry (its deployment, gate and per-run cell
figures), the history plot over the last deployments, and the comparison of two runs.

The entries are read back from the store as hostile input: capped, typed, one line naming the
file for one that is not an entry (exit 2 for `compare`; left out, and said, by the history).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from pipelines.core.errors import BadInput
from pipelines.core.files import load_json, write_atomic
from pipelines.stages.bench.intervals import bootstrap_interval

INDEX = "index.json"  # in each run's folder, <store>/bench/<profile>/<time>/
CAP = 4 * 1024 * 1024
# Cell figures kept per run in the entry, for `compare` and the history's intervals.
CELL_KEYS = ("output_throughput", "median_window_tok_s", "median_ttft_ms", "median_tpot_ms",
             "mean_e2el_ms")  # fmt: skip
FAILED = ("failed", "regressed")


class Deployment(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """What was deployed when the run measured it."""

    image: str | None = None
    manifests_key: str | None = None
    lock_sha256: str | None = None
    deployed_git: str | None = None
    deployed_at: float | None = None
    git: str | None = None


class GateRow(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """One gated metric of a run."""

    metric: str
    baseline: float
    tolerance: float
    better: str
    measured: float | None = None
    interval: list[float] | None = None
    runs: int = 0
    verdict: str = ""


class Entry(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """One bench run, indexed by its deployment."""

    profile: str
    started: float
    verdict: str
    deployment: Deployment
    gate: list[GateRow]
    cells: dict[str, dict[str, list[float]]]


def index_entry(results: dict[str, Any]) -> dict[str, Any]:
    """The run's entry: its deployment, verdict, gate rows and each cell's per-run figures."""
    p = results["provenance"]
    cells: dict[str, dict[str, list[float]]] = {}
    for cell in list(results.get("decode", [])) + [results.get("saturation") or {}]:
        runs = cell.get("repeats") or ([cell["summary"]] if cell.get("summary") else [])
        figures = {k: [r[k] for r in runs if isinstance(r.get(k), (int, float))] for k in CELL_KEYS}
        if runs:
            cells[cell["name"]] = {k: v for k, v in figures.items() if v}
    keys = ("image", "manifests_key", "lock_sha256", "deployed_git", "deployed_at", "git")
    return {
        "schema": 1,
        "profile": p.get("profile"),
        "started": p.get("started"),
        "verdict": results.get("verdict"),
        "deployment": {k: p.get(k) for k in keys},
        "gate": results.get("gate") or [],
        "cells": cells,
    }


def write_index(folder: Path, results: dict[str, Any]) -> Path:
    """The run's index entry, beside its results."""
    path = folder / INDEX
    write_atomic(path, msgspec.json.encode(index_entry(results)) + b"\n")
    return path


def read_entry(path: Path) -> Entry:
    """A run's entry (a run folder, its index.json, or its results.json's folder), or BadInput
    in one line naming the file."""
    if not path.exists():
        raise BadInput(f"{path}: no such run (expected a run's folder, <store>/bench/PROFILE/TIME)")
    if path.is_dir() or path.name == "results.json":
        path = (path if path.is_dir() else path.parent) / INDEX
    entry: Entry = load_json(path, CAP, BadInput, Entry)
    return entry


def read_history(area: Path) -> tuple[list[Entry], list[str]]:
    """Every run's entry under a profile's bench area, oldest first, and a line for each
    folder whose entry could not be read (left out)."""
    entries, skipped = [], []
    for index in sorted(area.glob(f"*/{INDEX}")):
        try:
            entries.append(read_entry(index))
        except BadInput as err:
            skipped.append(str(err))
    return sorted(entries, key=lambda e: e.started), skipped


def deployment_of(entry: Entry) -> tuple[str | None, ...]:
    """What identifies a deployment: image, manifests key, lock, deployed git."""
    d = entry.deployment
    return d.image, d.manifests_key, d.lock_sha256, d.deployed_git


def last_deployments(entries: list[Entry], last: int) -> list[Entry]:
    """The newest run of each of the last `last` deployments, oldest first."""
    newest: dict[tuple[str | None, ...], Entry] = {}
    for entry in entries:  # oldest first: a later run of a deployment replaces the earlier
        newest.pop(deployment_of(entry), None)
        newest[deployment_of(entry)] = entry
    return list(newest.values())[-last:]


def label(entry: Entry) -> str:
    """A deployment's short name on the plot: its manifests key's start (what tells apart two
    deployments of one image and commit, e.g. a changed env), deployed git, image digest's."""
    d = entry.deployment
    digest = (d.image or "").rpartition("sha256:")[2][:8]
    return f"{(d.manifests_key or '?')[:8]}\n{(d.deployed_git or '?')[:8]} {digest or '-'}"


def history_figure(entries: list[Entry], profile: str) -> Any:
    """Each gated metric over the deployments: the mean with its interval, the baseline and
    its tolerance band, failed runs marked."""
    from pipelines.stages.bench.plots import subplots

    metrics = list(dict.fromkeys(row.metric for e in entries for row in e.gate))
    fig, axes = subplots(len(metrics), 1, figsize=(10, 2.6 * len(metrics)), squeeze=False)
    x = list(range(len(entries)))
    for ax, metric in zip(axes[:, 0], metrics, strict=True):
        rows = [next((r for r in e.gate if r.metric == metric), None) for e in entries]
        known = [(i, r) for i, r in zip(x, rows, strict=True) if r and r.measured is not None]
        if known:
            base = known[-1][1]
            band = (base.baseline * (1 - base.tolerance), base.baseline * (1 + base.tolerance))
            ax.axhspan(*band, color="#cde8d5", label="baseline +- tolerance")
            ax.axhline(base.baseline, color="#2a9d8f", lw=1, label="baseline")
        for i, r in known:
            assert r.measured is not None
            span = r.interval or [r.measured, r.measured]
            bad = r.verdict in FAILED or entries[i].verdict in FAILED
            ax.errorbar(i, r.measured, yerr=[[r.measured - span[0]], [span[1] - r.measured]],
                        fmt="x" if bad else "o", color="#c0392b" if bad else "#1d3557",
                        capsize=3)  # fmt: skip
        ax.set_title(metric, fontsize=10)
        ax.set_xticks(x, [label(e) for e in entries], fontsize=8)
    axes[0, 0].legend(loc="best", fontsize=8)
    fig.suptitle(f"{profile}: gated metrics over the last {len(entries)} deployments (x: failed)")
    fig.tight_layout()
    return fig


def write_history(area: Path, profile: str, last: int = 10) -> tuple[Path | None, list[str]]:
    """history.png over the last deployments in the profile's bench area; its path (None when
    no run is indexed) and the lines for entries left out."""
    from pipelines.stages.bench.plots import pyplot, save

    entries, skipped = read_history(area)
    chosen = last_deployments(entries, last)
    if not chosen:
        return None, skipped
    fig = history_figure(chosen, profile)
    path = save(fig, area / "history.png")
    pyplot().close(fig)
    return path, skipped


def compare_lines(a: Entry, b: Entry) -> list[str]:
    """What changed from run A to run B: each gated metric and each cell figure, the means with
    their 95% intervals over the runs, the change, and whether the intervals are apart."""
    lines = []
    for name in dict.fromkeys([*a.cells, *b.cells]):
        for key in CELL_KEYS:
            va, vb = a.cells.get(name, {}).get(key), b.cells.get(name, {}).get(key)
            if va and vb:
                lines.append(change_line(f"{name}.{key}", va, vb))
    gates = {r.metric: r for r in a.gate}
    for row in b.gate:
        old = gates.get(row.metric)
        if old and old.measured is not None and row.measured is not None:
            lines.append(f"gate {row.metric}: {old.verdict or '?'} -> {row.verdict or '?'}")
    return lines


def change_line(name: str, a: list[float], b: list[float]) -> str:
    """One figure of two runs: means, intervals, change, and whether the intervals are apart
    (a side of one run has a point, not an interval: nothing to be apart)."""
    ma, mb = sum(a) / len(a), sum(b) / len(b)
    change = f"{(mb - ma) / ma:+.1%}" if ma else "n/a"
    return f"{name}: {figure(a)} -> {figure(b)} {change} ({separation(a, b)})"


def figure(values: list[float]) -> str:
    """A figure's mean over the runs, with its 95% interval when there are two runs or more."""
    mean = sum(values) / len(values)
    if len(values) < 2:
        return f"{mean:.4g}"
    low, high = bootstrap_interval(values)
    return f"{mean:.4g} [{low:.4g}..{high:.4g}]"


def separation(a: list[float], b: list[float]) -> str:
    """Whether the intervals of A and B are apart, or which side has one run (no interval)."""
    single = [side for side, values in (("A", a), ("B", b)) if len(values) < 2]
    if single:
        return ("one run each" if len(single) == 2 else f"one run in {single[0]}") + ": no interval"
    ia, ib = bootstrap_interval(a), bootstrap_interval(b)
    return "intervals apart" if ia[1] < ib[0] or ib[1] < ia[0] else "intervals overlap"
