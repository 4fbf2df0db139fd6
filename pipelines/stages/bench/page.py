"""The run as one self-contained report.html (tables, the gate, plots inline as PNG data) and
two CSVs: one row per request, one per cell.

Every text from a server or a record (error messages, model names, probe details) is escaped:
the page is opened in a browser and the server is not trusted.
"""

from __future__ import annotations

import base64
import csv
import io
from html import escape
from typing import Any

from pipelines.stages.bench.record import record_from_json
from pipelines.stages.bench.timing import Timing, request_timing

CELL_COLUMNS = (
    ("cell", "name"), ("concurrency", "concurrency"), ("runs", "repeats"),
    ("completed", "completed"), ("failed", "failed"), ("agg tok/s", "output_throughput"),
    ("window tok/s", "median_window_tok_s"),
    # The server's figures from its histograms over the cell, each beside the client's of the
    # same statistic: its means exactly, its medians estimated from its buckets.
    ("TTFT median ms", "median_ttft_ms"),
    ("server TTFT median ms (buckets)", "server_median_ttft_ms"),
    ("TTFT p99 ms", "p99_ttft_ms"), ("TPOT median ms", "median_tpot_ms"),
    ("ITL median ms", "median_itl_ms"),
    ("server ITL median ms (buckets)", "server_median_itl_ms"),
    ("ITL p99 ms", "p99_itl_ms"),
    ("TTFT mean ms", "mean_ttft_ms"), ("server TTFT mean ms", "server_mean_ttft_ms"),
    ("ITL mean ms", "mean_itl_ms"), ("server ITL mean ms", "server_mean_itl_ms"),
    ("E2EL mean ms", "mean_e2el_ms"), ("server E2EL mean ms", "server_mean_e2el_ms"),
    ("start spread ms", "start_spread_ms"), ("client stall s", "client_stall_s"),
    ("method", "method"),
)  # fmt: skip
REQUEST_COLUMNS = ("cell", "index", "status", "error", "prompt_tokens", "output_tokens",
                   "ttft_ms", "e2el_ms", "tpot_ms", "method")  # fmt: skip
STYLE = """body{font:14px/1.4 sans-serif;margin:2em;color:#222}
table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #bbb;padding:3px 8px}
th{background:#eee}.passed{color:#1b7f3b}.regressed,.failed,.no{color:#c0392b}
.inconclusive{color:#b8860b}img{max-width:100%;display:block;margin:1em 0}"""


def cells_of(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The sweep's cells, then saturation's, as the run's JSON has them."""
    saturation = results.get("saturation")
    return list(results.get("decode", [])) + ([saturation] if saturation else [])


def timings_of(cell: dict[str, Any]) -> list[tuple[dict[str, Any], Timing | None]]:
    """Each request of a cell with its timings (None when it failed)."""
    return [(r, request_timing(record_from_json(r))) for r in cell.get("requests") or []]


def number(value: Any, digits: int = 1) -> str:
    """A number for a table cell ('-' when there is none)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "-" if value is None else str(value)
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def cell_rows(results: dict[str, Any]) -> list[list[str]]:
    """One row per cell: its merged figures, or why it was refused."""
    rows = []
    for cell in cells_of(results):
        s = {**(cell.get("summary") or {}), "name": cell["name"]}
        s.setdefault("concurrency", cell.get("concurrency"))
        s["repeats"] = len(cell.get("repeats") or []) or (1 if cell.get("summary") else 0)
        if cell.get("refused"):
            s["method"] = f"refused: {cell['refused']}"
        rows.append([number(s.get(key)) for _, key in CELL_COLUMNS])
    return rows


def request_rows(results: dict[str, Any]) -> list[list[str]]:
    """One row per request of every cell."""
    rows = []
    for cell in cells_of(results):
        for i, (r, t) in enumerate(timings_of(cell)):
            ms = (t.ttft * 1000, t.e2el * 1000, t.tpot * 1000 if t.tpot else None) if t else ()
            values = [cell["name"], i, r.get("status"), r.get("error") or "",
                      r.get("prompt_tokens"), t.output_tokens if t else None, *ms]  # fmt: skip
            values += [None] * (len(REQUEST_COLUMNS) - 1 - len(values))
            rows.append([number(v, 3) for v in values] + [t.method if t else ""])
    return rows


def csv_text(header: tuple[str, ...] | list[str], rows: list[list[str]]) -> str:
    """Rows as CSV text with a header."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(header)
    writer.writerows(rows)
    return out.getvalue()


def table(header: list[str] | tuple[str, ...], rows: list[list[str]]) -> str:
    """An HTML table, every cell escaped."""
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def png_data(fig: Any) -> str:
    """A matplotlib figure as a data: URI (the page carries its plots)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def figures(results: dict[str, Any]) -> list[tuple[str, str]]:
    """The page's plots as (title, data URI): throughput and TTFT against concurrency, the TTFT
    of every request per cell, the ITL histogram, the needles."""
    from pipelines.stages.bench.plots import (
        decode_figure,
        itl_figure,
        needles_figure,
        pyplot,
        ttft_figure,
    )

    timed = {c["name"]: [t for _, t in timings_of(c) if t] for c in cells_of(results)}
    made = [
        ("Decode sweep", decode_figure(results)),
        ("TTFT per cell", ttft_figure({n: [t.ttft * 1000 for t in ts] for n, ts in timed.items()})),
        (
            "Inter-token latency",
            itl_figure([x * 1000 for ts in timed.values() for t in ts for x in t.itls]),
        ),  # fmt: skip
        ("Needles", needles_figure(results)),
    ]
    out = []
    for title, fig in made:
        if fig is not None:
            out.append((title, png_data(fig)))
            pyplot().close(fig)
    return out


def gate_html(results: dict[str, Any]) -> str:
    """The gate's rows (mean, interval, verdict) and its lines."""
    rows = []
    for g in results.get("gate") or []:
        interval = g.get("interval")
        rows.append([g["metric"], f"{g['baseline']:g}", number(g.get("measured"), 4),
                     f"{interval[0]:.4g}..{interval[1]:.4g}" if interval else "-",
                     str(g.get("runs", "")), f"{g['tolerance']:.0%} ({g['better']} is better)",
                     g.get("verdict", "")])  # fmt: skip
    header = ["metric", "baseline", "mean", "95% interval", "runs", "tolerance", "verdict"]
    lines = [f"<li>{escape(f)}</li>" for f in results.get("failures") or []]
    lines += [f"<li>{escape(f)}</li>" for f in results.get("inconclusive") or []]
    return table(header, rows) + (f"<ul>{''.join(lines)}</ul>" if lines else "")


def report_html(results: dict[str, Any]) -> str:
    """The whole run as one page that needs nothing else."""
    p = results["provenance"]
    verdict = results.get("verdict", "")
    keys = ("profile", "endpoint", "model", "image", "lock_sha256", "manifests_key",
            "deployed_git", "git", "started_iso")  # fmt: skip
    provenance = [[k, str(p.get(k))] for k in keys]
    probes = [[x["name"], "yes" if x["passed"] else "no", x["detail"]]
              for x in results.get("probes") or []]  # fmt: skip
    needles = [[str(n["target_tokens"]), number(n["prompt_tokens"]), "yes" if n["correct"]
                else "no", number(n["seconds"]), n.get("error") or ""]
               for n in results.get("needles") or []]  # fmt: skip
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'>",
        f"<title>bench {escape(str(p.get('profile')))}: {escape(verdict)}</title>",
        f"<style>{STYLE}</style></head><body>",
        f"<h1>Benchmark of {escape(str(p.get('profile')))}</h1>",
        f"<p>Verdict: <strong class='{escape(verdict)}'>{escape(verdict)}</strong></p>",
        "<h2>Provenance</h2>",
        table(["what", "value"], provenance),
        "<h2>Gate</h2>",
        gate_html(results),
        "<h2>Cells</h2>",
        table([c for c, _ in CELL_COLUMNS], cell_rows(results)),
        "<h2>Probes</h2>",
        table(["probe", "passed", "detail"], probes),
        "<h2>Needles</h2>",
        table(["target", "prompt tokens", "correct", "seconds", "error"], needles),  # fmt: skip
        "<h2>Plots</h2>",
    ]
    parts += [f"<h3>{escape(t)}</h3><img alt='{escape(t)}' src='{uri}'>" for t, uri in
              figures(results)]  # fmt: skip
    return "\n".join(parts) + "\n</body></html>\n"


def page_files(results: dict[str, Any]) -> dict[str, bytes]:
    """report.html, cells.csv and requests.csv, by file name."""
    cells = csv_text([c for c, _ in CELL_COLUMNS], cell_rows(results))
    return {
        "report.html": report_html(results).encode(),
        "cells.csv": cells.encode(),
        "requests.csv": csv_text(REQUEST_COLUMNS, request_rows(results)).encode(),
    }
