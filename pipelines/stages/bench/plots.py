"""PNG plots of a run: tok/s and TTFT against concurrency, needle time against length."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def pyplot() -> Any:
    """matplotlib's pyplot on the file-only backend (no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def subplots(*args: Any, **kwargs: Any) -> tuple[Figure, Any]:
    """pyplot.subplots, typed: the figure and its axes."""
    fig, axes = pyplot().subplots(*args, **kwargs)
    return fig, axes


def decode_figure(results: dict[str, Any]) -> Figure | None:
    """Throughput (aggregate, per stream) and TTFT (median, p99) against concurrency."""
    cells = [c for c in results.get("decode", []) if c.get("summary")]
    if not cells:
        return None
    conc = [c["concurrency"] for c in cells]
    fig, (rate, ttft) = subplots(1, 2, figsize=(11, 4))
    series = (
        ("output_throughput", "aggregate"),
        ("median_window_tok_s", "per stream (window)"),
    )
    for key, label in series:
        rate.plot(conc, [c["summary"].get(key) or 0 for c in cells], marker="o", label=label)
    rate.set(xlabel="concurrent streams", ylabel="tok/s", title="Decode throughput")
    rate.set_xscale("log", base=2)
    rate.set_xticks(conc, [str(c) for c in conc])
    rate.set_ylim(bottom=0)
    rate.legend()
    for key, label in (("median_ttft_ms", "median"), ("p99_ttft_ms", "p99")):
        values = [(c["summary"].get(key) or 0) / 1000 for c in cells]
        ttft.plot(conc, values, marker="o", label=label)
    ttft.set(xlabel="concurrent streams", ylabel="seconds", title="Time to first token")
    ttft.set_xscale("log", base=2)
    ttft.set_xticks(conc, [str(c) for c in conc])
    ttft.set_ylim(bottom=0)
    ttft.legend()
    fig.suptitle(f"{results['provenance']['profile']}: decode sweep")
    fig.tight_layout()
    return fig


def needles_figure(results: dict[str, Any]) -> Figure | None:
    """Needle time against prompt length, green when answered."""
    needles = [n for n in results.get("needles", []) if n.get("seconds") is not None]
    if not needles:
        return None
    fig, ax = subplots(figsize=(6, 4))
    lengths = [n["prompt_tokens"] or n["target_tokens"] for n in needles]
    colors = ["#2a9d8f" if n["correct"] else "#e63946" for n in needles]
    ax.scatter(lengths, [n["seconds"] for n in needles], c=colors)
    ax.set(xlabel="prompt tokens", ylabel="seconds", title="Needles (green: correct)")
    fig.tight_layout()
    return fig


def ttft_figure(timings: dict[str, list[float]]) -> Figure | None:
    """The TTFT of every request, one box per cell (timings: cell name -> TTFTs in ms)."""
    named = {name: values for name, values in timings.items() if values}
    if not named:
        return None
    fig, ax = subplots(figsize=(11, 4))
    ax.boxplot(list(named.values()), tick_labels=list(named))
    ax.set(xlabel="cell", ylabel="ms", title="TTFT of every request, per cell")
    ax.set_ylim(bottom=0)
    fig.tight_layout()
    return fig


def itl_figure(itls: list[float]) -> Figure | None:
    """A histogram of every inter-token latency of the run (ms)."""
    if not itls:
        return None
    fig, ax = subplots(figsize=(11, 4))
    ax.hist(itls, bins=60, color="#457b9d")
    ax.set(xlabel="ms", ylabel="tokens", title="Inter-token latency, every token of the run")
    fig.tight_layout()
    return fig


def plot_results(results: dict[str, Any], folder: Path) -> list[Path]:
    """Write the run's PNG plots (decode sweep, needles) into folder; their paths."""
    plt = pyplot()
    written = []
    for name, fig in (("decode", decode_figure(results)), ("needles", needles_figure(results))):
        if fig is not None:
            written.append(save(fig, folder / f"{name}.png"))
            plt.close(fig)
    return written


def save(fig: Figure, path: Path) -> Path:
    """Save a figure under a temporary name, then rename: no half-written PNG."""
    partial = path.with_suffix(".partial.png")
    fig.savefig(partial, dpi=110)
    partial.replace(path)
    return path
