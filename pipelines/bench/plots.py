"""PNG plots of a run: tok/s and TTFT against concurrency, needle time against length."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def plot_results(results: dict[str, Any], folder: Path) -> list[Path]:
    """Write the run's plots into folder; their paths."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    written = []
    cells = [c for c in results.get("decode", []) if c.get("summary")]
    if cells:
        conc = [c["concurrency"] for c in cells]
        fig, (rate, ttft) = plt.subplots(1, 2, figsize=(11, 4))
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
        written.append(save(fig, folder / "decode.png"))
        plt.close(fig)
    needles = [n for n in results.get("needles", []) if n.get("seconds") is not None]
    if needles:
        fig, ax = plt.subplots(figsize=(6, 4))
        lengths = [n["prompt_tokens"] or n["target_tokens"] for n in needles]
        colors = ["#2a9d8f" if n["correct"] else "#e63946" for n in needles]
        ax.scatter(lengths, [n["seconds"] for n in needles], c=colors)
        ax.set(xlabel="prompt tokens", ylabel="seconds", title="Needles (green: correct)")
        fig.tight_layout()
        written.append(save(fig, folder / "needles.png"))
        plt.close(fig)
    return written


def save(fig: Figure, path: Path) -> Path:
    """Save a figure under a temporary name, then rename: no half-written PNG."""
    partial = path.with_suffix(".partial.png")
    fig.savefig(partial, dpi=110)
    partial.replace(path)
    return path
