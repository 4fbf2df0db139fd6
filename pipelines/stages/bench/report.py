"""A run's results as one JSON, a Markdown report, a printed table and PNG plots."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipelines.core.files import write_atomic

COLUMNS = (
    ("C", "concurrency", "{:.0f}"),
    ("ok/failed", None, ""),
    ("agg tok/s", "output_throughput", "{:.1f}"),
    ("window tok/s (median)", "median_window_tok_s", "{:.2f}"),
    ("TTFT median ms", "median_ttft_ms", "{:.0f}"),
    # The server's median from its histogram's buckets (as fine as they are), beside the client's.
    ("server TTFT median ms (buckets)", "server_median_ttft_ms", "{:.0f}"),
    ("TTFT p99 ms", "p99_ttft_ms", "{:.0f}"),
    ("TPOT median ms", "median_tpot_ms", "{:.1f}"),
    ("ITL p99 ms", "p99_itl_ms", "{:.1f}"),
    # The server's histograms give means only: mean beside mean, never beside a median.
    ("TTFT mean ms", "mean_ttft_ms", "{:.0f}"),
    ("server TTFT mean ms", "server_mean_ttft_ms", "{:.0f}"),
    ("ITL mean ms", "mean_itl_ms", "{:.1f}"),
    ("server ITL mean ms", "server_mean_itl_ms", "{:.1f}"),
    ("method", "method", "{}"),
)


def cell_row(cell: dict[str, Any]) -> list[str]:
    """One table row of a cell (a refused cell says why)."""
    s = cell.get("summary") or {}
    if cell.get("refused"):
        return [str(cell["concurrency"]), f"refused: {cell['refused']}"] + [""] * (len(COLUMNS) - 2)
    row = []
    for _, key, fmt in COLUMNS:
        if key is None:
            row.append(f"{s.get('completed', 0)}/{s.get('failed', 0)}")
        else:
            value = s.get(key)
            row.append(fmt.format(value) if value is not None else "-")
    return row


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    """A GitHub Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def decode_table(results: dict[str, Any]) -> str:
    """The decode sweep (and saturation) as a Markdown table."""
    cells = list(results.get("decode", []))
    if results.get("saturation"):
        cells.append({**results["saturation"], "concurrency": results["saturation"]["concurrency"]})
    return markdown_table([c[0] for c in COLUMNS], [cell_row(c) for c in cells])


def markdown_report(results: dict[str, Any], plots: list[str]) -> str:
    """The whole run in Markdown: provenance, probes, sweep, saturation, needles, gate."""
    p = results["provenance"]
    lines = [
        f"# Benchmark of `{p['profile']}` at {p['endpoint']}",
        "",
        f"- image: `{p.get('image')}`",
        f"- lock sha256: `{p.get('lock_sha256')}`; manifests key: `{p.get('manifests_key')}`",
        f"- deployed at git `{p.get('deployed_git')}`; bench at git `{p.get('git')}`",
        f"- started {p.get('started_iso')}; verdict: **{results['verdict']}**",
        "",
        "Token times are exact where the server streams continuous usage (the `method` column);",
        "TTFT is timed to the first chunk that carries output, never the role-only chunk.",
        "",
        "## Probes",
        "",
        markdown_table(
            ["probe", "passed", "detail"],
            [
                [x["name"], "yes" if x["passed"] else "**no**", x["detail"]]
                for x in results["probes"]
            ],
        ),
        "",
        "## Decode sweep and saturation",
        "",
        decode_table(results),
    ]
    sat = (results.get("saturation") or {}).get("summary") or {}
    if sat.get("steady_output_throughput"):
        span = sat["steady_end"] - sat["steady_start"]
        lines += [
            "",
            f"Saturation steady state: {sat['steady_output_throughput']:.1f} tok/s"
            f" over {span:.1f} s.",
        ]
    if results.get("needles"):
        lines += ["", "## Needles", ""]
        rows = [
            [
                str(n["target_tokens"]),
                str(n["prompt_tokens"]),
                "yes" if n["correct"] else "**no**",
                f"{n['seconds']:.1f}" if n["seconds"] is not None else "-",
                n["error"] or "",
            ]
            for n in results["needles"]
        ]
        lines.append(
            markdown_table(["target", "prompt tokens", "correct", "seconds", "error"], rows)
        )
    lines += ["", "## Gate", ""]
    if results["gate"]:
        rows = [
            [
                g["metric"],
                f"{g['baseline']:g}",
                f"{g['measured']:.4g}" if g["measured"] is not None else "-",
                interval_text(g),
                f"{g['change']:+.1%}" if g["change"] is not None else "-",
                f"{g['tolerance']:.0%} ({g['better']} is better)",
                g.get("verdict", ""),
            ]
            for g in results["gate"]
        ]
        lines.append(
            markdown_table(
                [
                    "metric",
                    "baseline",
                    "measured",
                    "95% interval",
                    "change",
                    "tolerance",
                    "verdict",
                ],
                rows,
            )
        )
    lines += ["", "Failed expectations:", ""]
    lines += [f"- {f}" for f in results["failures"]] or ["- none"]
    if results.get("inconclusive"):
        lines += ["", "Not decided yet:", ""] + [f"- {f}" for f in results["inconclusive"]]
    lines += [""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots]
    return "\n".join(lines) + "\n"


def verdict_of(results: dict[str, Any]) -> str:
    """failed (a failure), inconclusive (the gate cannot decide yet), else passed."""
    if results["failures"]:
        return "failed"
    return "inconclusive" if results.get("inconclusive") else "passed"


def write_results(folder: Path, results: dict[str, Any]) -> tuple[Path, Path]:
    """results.json, report.md, report.html and the CSVs (with the plots and the final
    verdict) in folder; the paths of the JSON and of report.md."""
    folder.mkdir(parents=True, exist_ok=True)
    from pipelines.stages.bench.history import write_index
    from pipelines.stages.bench.page import page_files
    from pipelines.stages.bench.plots import plot_results

    try:
        plots = plot_results(results, folder)
    except Exception as err:  # noqa: BLE001 - a plot that fails must not lose the numbers
        results["failures"].append(f"plots: {type(err).__name__}: {err}")
        plots = []
    # Set here, not by the gate: a plot that failed is the last failure a run can add.
    results["verdict"] = verdict_of(results)
    try:
        page = page_files(results)
    except Exception as err:  # noqa: BLE001 - nor a page that fails
        results["failures"].append(f"report.html: {type(err).__name__}: {err}")
        results["verdict"], page = verdict_of(results), {}
    data = folder / "results.json"
    write_atomic(data, (json.dumps(results, indent=1, sort_keys=True) + "\n").encode())
    report = folder / "report.md"
    write_atomic(report, markdown_report(results, [str(p) for p in plots]).encode())
    for name, content in page.items():
        write_atomic(folder / name, content)
    write_index(folder, results)  # last: an indexed run is a whole one
    return data, report


def interval_text(row: dict[str, Any]) -> str:
    """A gate row's interval and runs, or '-' when it was not measured."""
    if not row.get("interval"):
        return "-"
    low, high = row["interval"]
    return f"{low:.4g}..{high:.4g} ({row['runs']} runs)"
