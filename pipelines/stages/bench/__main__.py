"""The harness by hand, against any OpenAI-compatible endpoint, outside the pipeline.

    python -m pipelines.stages.bench cell --url http://127.0.0.1:8000 --model NAME \\
        --concurrency 8 --requests 16 --max-tokens 768 --prompt-tokens 256 --out cell.json
    python -m pipelines.stages.bench probes --url ... --model NAME
    python -m pipelines.stages.bench compare RUN_A RUN_B

`cell` writes one closed-loop cell's summary under vLLM's key names at the top level, with
the raw per-request timings under `requests`; `probes` prints the correctness probes.
`--prompt-tokens` is the server's own count (its /tokenize, else a one-token request's usage).
`compare` prints what changed between two runs (their folders under <store>/bench/<profile>/):
each cell figure's mean and 95% interval over the runs, and each gated metric's verdict.
Exit codes: 2 a bad option or a run that cannot be read, 3 nothing measured whole (no server
at the URL, a refused cell, failed requests: each reason with its count; a client that stalled),
1 a probe that failed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pipelines.core.errors import BadInput, run_main
from pipelines.core.files import write_atomic
from pipelines.core.progress import say, show
from pipelines.stages.bench.failures import NotMeasured
from pipelines.stages.bench.load import CellSpec, run_cell
from pipelines.stages.bench.probes import run_probes
from pipelines.stages.bench.run import cell_line, fitted_sweep_body
from pipelines.stages.bench.serverview import not_serving
from pipelines.stages.bench.stall import stall_note
from pipelines.stages.bench.timing import failure_reasons


def main(argv: list[str] | None = None) -> int:
    """Run one command; the exit status says whether everything asked for passed."""
    parser = argparse.ArgumentParser(prog="python -m pipelines.stages.bench", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    cell = sub.add_parser("cell", help="one closed-loop cell")
    probes = sub.add_parser("probes", help="the correctness probes")
    for p in (cell, probes):
        p.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
        p.add_argument("--model", required=True, help="the served model name")
        p.add_argument("--timeout", type=float, default=900.0, help="seconds per request")
    cell.add_argument("--concurrency", type=int, default=1)
    cell.add_argument("--requests", type=int, default=8)
    cell.add_argument("--max-tokens", type=int, default=768)
    cell.add_argument("--prompt-tokens", type=int, default=256)
    cell.add_argument("--warmup", type=int, default=1)
    cell.add_argument("--out", type=Path, help="write the cell's JSON here")
    probes.add_argument("--min-context", type=int, default=0)
    compare = sub.add_parser("compare", help="what changed between two runs")
    compare.add_argument("runs", nargs=2, type=Path, metavar="RUN", help="a run's folder")
    args = parser.parse_args(argv)
    if args.command == "compare":
        from pipelines.stages.bench.history import compare_lines, read_entry

        a, b = (read_entry(run) for run in args.runs)
        show(f"{args.runs[0]} ({a.verdict}) -> {args.runs[1]} ({b.verdict})")
        for line in compare_lines(a, b):
            show(line)
        return 0
    url = args.url.rstrip("/")
    if args.command == "probes":
        results = run_probes(url, args.model, args.min_context, args.timeout)
        for probe in results:
            say(probe.name, f"{'ok' if probe.passed else 'FAILED'} ({probe.detail})")
        return 0 if all(p.passed for p in results) else 1
    for option in ("concurrency", "requests", "max_tokens", "prompt_tokens"):
        if getattr(args, option) < 1:
            flag = "--" + option.replace("_", "-")
            raise BadInput(
                f"{flag}: expected a whole number of 1 or more, got {getattr(args, option)}"
            )
    if why := not_serving(url, args.model):
        raise NotMeasured(f"cell c{args.concurrency} not measured: {why}")
    body = fitted_sweep_body(url, args.model, args.prompt_tokens, args.max_tokens, args.timeout)
    spec = CellSpec(f"c{args.concurrency}", args.concurrency, args.requests, body, args.timeout)
    result = run_cell(url, CellSpec(**{**spec.__dict__, "warmup": args.warmup}))
    show(cell_line(result))
    data = {**result.summary, "refused": result.refused, **result.as_json()}
    if args.out:
        write_atomic(args.out, (json.dumps(data, indent=1) + "\n").encode())
    if result.refused:
        raise NotMeasured(f"cell {result.name} not measured: {result.refused}")
    if failed := result.summary.get("failed"):
        raise NotMeasured(
            f"cell {result.name}: {failed} of {args.requests} requests failed:"
            f" {failure_reasons(result.summary)}"
        )
    if note := stall_note(result.summary):
        raise NotMeasured(f"cell {result.name}: {note}")
    return 0


if __name__ == "__main__":
    run_main(main)
