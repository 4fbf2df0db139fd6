"""Bar charts of benchmark medians, written next to the scripts as tests/perf/out/<name>.png."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent / "out"


def pyplot() -> Any:
    """matplotlib's pyplot drawing into files only, loaded when a chart is drawn: the test
    workers import the helpers of this folder (tests/conftest.py), and pyplot was 0.3 s of
    each worker's collection."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def bar_chart(name: str, title: str, unit: str, values: dict[str, float]) -> Path:
    """One horizontal bar per tool (ours first), the value printed on each; returns the path."""
    OUT.mkdir(exist_ok=True)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 0.6 * len(values) + 1.5))
    labels = list(values)[::-1]
    bars = ax.barh(
        labels,
        [values[k] for k in labels],
        color=["#4c72b0" if "sparkforge" in k or "ours" in k else "#999999" for k in labels],
    )
    ax.bar_label(bars, fmt="%.2f", padding=3)
    ax.set_xlabel(unit)
    ax.set_title(textwrap.fill(title, 80), fontsize=10)  # long titles (a link's shape) wrap
    ax.margins(x=0.15)
    fig.tight_layout()
    path = OUT / f"{name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def rate_chart(name: str, title: str, series: dict[str, list[tuple[float, float]]]) -> Path:
    """Rate over time, one line per tool (ours first, thicker); returns the path."""
    OUT.mkdir(exist_ok=True)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    for label, points in series.items():
        ours = "sparkforge" in label or "ours" in label
        ax.plot(*zip(*points, strict=True), label=label, linewidth=2 if ours else 1)
    ax.set_xlabel("seconds since the tool started")
    ax.set_ylabel("Gbit/s over the link")
    ax.set_ylim(bottom=0)
    ax.legend(loc="lower center", fontsize=8)
    ax.set_title(textwrap.fill(title, 80), fontsize=10)
    fig.tight_layout()
    path = OUT / f"{name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
