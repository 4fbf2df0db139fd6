"""Accuracy race: our bench harness and the public ones against the simulator's server-side truth.

Run: .venv/bin/python tests/perf/bench_accuracy.py [--requests 16] [--skip-install]
     [--tools ours,guidellm,aiperf,vllm] [--retry-install]

What it compares. The simulated runtime (images/local-sim/sim) is started with a known
timing model, twice: one token per chunk, then three tokens per chunk (as speculative decoding
streams them). At concurrency 1 and 8 every tool gets the same load, one tool after another
in the same run: N requests of P prompt tokens and exactly M output tokens (ignore_eos, the
simulator writes max_tokens tokens), closed loop, streaming /v1/chat/completions. Before each
tool `/sim/requests` is cleared; after it the server's own record is read, and the truth is
computed from it: TTFT = first token-carrying chunk written - request received; TPOT =
(last token chunk - first token chunk) / (tokens - 1) per request; ITL = the gaps between
token chunks, a chunk of k tokens counted as k gaps of gap/k; output tok/s = all tokens /
(last finish - first receipt). Only the tool's measured requests count: full-length ones, the
last N received (warm-ups and a tool's own test request are shorter or earlier). Each tool's
own result file is parsed (its keys are named in PARSERS) and its relative error against the
truth printed as a Markdown table, written with the raw numbers to tests/perf/out/
bench_accuracy.{md,json} and plotted as tests/perf/out/bench_accuracy.png.

The tools. Ours: `python -m pipelines.stages.bench cell`. The peers, each in its own venv under
tests/perf/out/venvs/<tool>-<version>/ made here and reused while its pins (PEERS) are the
same: guidellm (`guidellm run`, openai_http backend), AIPerf (`aiperf profile`, chat
endpoint) and vLLM's `vllm bench serve` (openai-chat backend), when it installs; a failed
install is recorded next to the venv and not retried without --retry-install. Nothing can
be fetched from a model hub here: the peers get the simulator's Hugging Face tokenizer.json
(WordLevel over its vocabulary, counting as the server counts) from a temp folder.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))

import matplotlib.pyplot as plt  # noqa: E402
from plot import OUT  # noqa: E402  (Agg backend set there)

SIM_DIR = ROOT / "images" / "local-sim"  # run from there: `python -m sim`, as in the image
# -B: bytecode left in the image folder would enter local-sim's build context and its key.
SIM = [sys.executable, "-B", "-m", "sim"]
VENVS = OUT / "venvs"
RUNS = OUT / "accuracy"
MODEL = "sim"
PROMPT_TOKENS = 256
MAX_TOKENS = 128
CONCURRENCY = (1, 8)
INSTALL_TIMEOUT_S = 1800
TOOL_TIMEOUT_S = 900

# The timing model: TTFT 0.2 s + 256 / 2000 s, 60 tok/s per stream falling as 1/c^0.15
# (43.9 tok/s at 8 running), eight slots so C=8 never queues.
BASE_MODEL = {
    "SIM_TTFT_S": "0.2",
    "SIM_PREFILL_TOK_S": "2000",
    "SIM_DECODE_TOK_S": "60",
    "SIM_DECODE_FALLOFF": "0.15",
    "SIM_MAX_RUNNING": "8",
    "SIM_MAX_MODEL_LEN": "32768",
}
CONFIGS = {
    "1 tok/chunk": {**BASE_MODEL, "SIM_TOKENS_PER_CHUNK": "1"},
    "3 tok/chunk": {**BASE_MODEL, "SIM_TOKENS_PER_CHUNK": "3"},
}
METRICS = {  # key: heading
    "ttft_mean": "TTFT mean",
    "ttft_median": "TTFT median",
    "tpot_mean": "TPOT mean",
    "itl_mean": "ITL mean",
    "output_tok_s": "output tok/s",
}


@dataclass(frozen=True)
class Peer:
    """A public harness: its name, the pins of its venv, and its console script."""

    name: str
    pins: tuple[str, ...]
    script: str

    @property
    def venv(self) -> Path:
        return VENVS / f"{self.name}-{self.pins[0].split('==')[1]}"


PEERS = {
    # guidellm requires torch; the CPU wheel of 2.13.0 lies on this machine's disk, any
    # other torch is a CUDA build of several GB.
    "guidellm": Peer("guidellm", ("guidellm==0.8.1", "torch==2.13.0"), "guidellm"),
    "aiperf": Peer("aiperf", ("aiperf==0.13.0",), "aiperf"),
    # vllm pins its own torch (2.14.0, CUDA build): a large install, tried with a time limit.
    "vllm": Peer("vllm", ("vllm==0.33.0",), "vllm"),
}


# --- peers' venvs ---------------------------------------------------------------------------


def ensure_venv(peer: Peer, install: bool, retry: bool) -> tuple[Path | None, str]:
    """The peer's venv with its pins installed, or None and why; made once, then reused."""
    marker = peer.venv / ".bench-accuracy-pins"
    failed = peer.venv.with_suffix(".failed")
    want = "\n".join(peer.pins) + "\n"
    if marker.is_file() and marker.read_text() == want:
        return peer.venv, "reused"
    if not install:
        return None, f"not installed ({peer.venv} has no venv with these pins; --skip-install)"
    if failed.is_file() and not retry:
        return None, failed.read_text().strip()
    VENVS.mkdir(parents=True, exist_ok=True)
    log = peer.venv.with_suffix(".log")
    print(f"installing {' '.join(peer.pins)} into {peer.venv} (log: {log}) ...", flush=True)
    started = time.monotonic()
    try:
        if not (peer.venv / "bin" / "python").exists():
            subprocess.run([sys.executable, "-m", "venv", str(peer.venv)], check=True)
        with log.open("w") as out:
            done = subprocess.run(
                [str(peer.venv / "bin" / "pip"), "install", "--progress-bar", "off", *peer.pins],
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=INSTALL_TIMEOUT_S,
            )
        if done.returncode != 0:
            errors = [ln for ln in log.read_text().splitlines() if "ERROR" in ln][-3:]
            raise RuntimeError(f"pip exit {done.returncode}: {' | '.join(errors)}")
    except (subprocess.TimeoutExpired, subprocess.CalledProcessError, RuntimeError) as err:
        reason = f"install failed after {time.monotonic() - started:.0f} s: {err}"
        failed.write_text(reason + "\n")
        return None, reason
    marker.write_text(want)
    failed.unlink(missing_ok=True)
    return peer.venv, f"installed in {time.monotonic() - started:.0f} s"


# --- the simulator and its truth ------------------------------------------------------------


def make_model(folder: Path) -> Path:
    """The smallest model folder the simulator accepts: config, index and its one shard."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"model_type": "deepseek_v41"}')
    index = {"weight_map": {"layers.0.weight": "model-00001-of-00001.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    (folder / "model-00001-of-00001.safetensors").write_bytes(b"\0" * 64)
    return folder


def make_tokenizer(folder: Path) -> Path:
    """The simulator's tokenizer.json with a minimal tokenizer_config.json for the peers.

    The config names no unk_token: marked special, [UNK] is dropped by a decode with
    skip_special_tokens (guidellm's synthetic prompts are decoded so, and would shrink
    from 256 tokens to a handful); as a plain word it is one token to the server too.
    """
    subprocess.run([*SIM, "--write-tokenizer", str(folder)], cwd=SIM_DIR, check=True)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": int(BASE_MODEL["SIM_MAX_MODEL_LEN"]),
        "chat_template": "{% for m in messages %}{{ m['content'] }}\n{% endfor %}",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    return folder


class Simulator:
    """The simulated runtime as a process on a free loopback port."""

    def __init__(self, model: Path, env: dict[str, str]):
        full = {**os.environ, **env, "SIM_MODEL_DIR": str(model), "SIM_PORT": "0"}
        full["SIM_SERVED_MODEL_NAME"] = MODEL
        self.proc = subprocess.Popen(SIM, cwd=SIM_DIR, env=full, stderr=subprocess.PIPE, text=True)
        line = self.proc.stderr.readline()
        if "serving" not in line:
            self.proc.kill()
            raise RuntimeError(f"simulator did not start: {line.strip()}")
        self.url = "http://" + line.rsplit(" on ", 1)[1].strip()

    def truth(self) -> list[dict]:
        with urllib.request.urlopen(f"{self.url}/sim/requests", timeout=30) as r:
            return json.load(r)

    def clear(self) -> None:
        req = urllib.request.Request(f"{self.url}/sim/requests", method="DELETE")
        urllib.request.urlopen(req, timeout=30).close()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


def measured(records: list[dict], requests: int, max_tokens: int) -> list[dict]:
    """The tool's measured requests: completed at full length, the last N received."""
    full = [r for r in records if r["status"] == "ok" and r["completion_tokens"] == max_tokens]
    return sorted(full, key=lambda r: r["received"])[-requests:]


def truth_metrics(records: list[dict]) -> dict[str, float | None]:
    """The server-side truth of a set of requests, in the table's units (ms, tok/s)."""
    ttfts, tpots, itls = [], [], []
    tokens = 0
    for r in records:
        chunks = [(t, n) for t, _, n in r["chunks"] if n > 0]
        ttfts.append(chunks[0][0] - r["received"])
        n = sum(k for _, k in chunks)
        tokens += n
        if n > 1:
            tpots.append((chunks[-1][0] - chunks[0][0]) / (n - 1))
        for (t0, _), (t1, k) in zip(chunks, chunks[1:], strict=False):
            itls += [(t1 - t0) / k] * k
    if not records:
        return dict.fromkeys(METRICS)
    span = max(r["finished"] for r in records) - min(r["received"] for r in records)
    return {
        "ttft_mean": statistics.fmean(ttfts) * 1000,
        "ttft_median": statistics.median(ttfts) * 1000,
        "tpot_mean": statistics.fmean(tpots) * 1000 if tpots else None,
        "itl_mean": statistics.fmean(itls) * 1000 if itls else None,
        "output_tok_s": tokens / span if span > 0 else None,
    }


# --- the tools: invocation and result parsing -----------------------------------------------


@dataclass(frozen=True)
class Load:
    """One cell's load, the same for every tool."""

    url: str
    concurrency: int
    requests: int
    prompt_tokens: int
    max_tokens: int
    tokenizer: Path


@dataclass
class ToolRun:
    """What one tool reported for a cell, how it was run, and what went wrong."""

    tool: str
    endpoint: str
    command: list[str] = field(default_factory=list)
    reported: dict[str, float | None] = field(default_factory=dict)
    error: str | None = None
    seconds: float = 0.0


def dig(data: Any, *path: str) -> float | None:
    """data[path[0]][path[1]]..., or None where a key is missing."""
    for key in path:
        if not isinstance(data, dict) or key not in data:
            return None
        data = data[key]
    return float(data) if isinstance(data, int | float) else None


def ours_command(load: Load, out: Path, venv: Path | None) -> list[str]:
    return [
        sys.executable, "-m", "pipelines.stages.bench", "cell", "--url", load.url, "--model", MODEL,
        "--concurrency", str(load.concurrency), "--requests", str(load.requests),
        "--max-tokens", str(load.max_tokens), "--prompt-tokens", str(load.prompt_tokens),
        "--out", str(out / "result.json"),
    ]  # fmt: skip


def ours_parse(out: Path) -> dict[str, float | None]:
    """Ours writes vLLM's key names at the top level."""
    d = json.loads((out / "result.json").read_text())
    return {
        "ttft_mean": dig(d, "mean_ttft_ms"),
        "ttft_median": dig(d, "median_ttft_ms"),
        "tpot_mean": dig(d, "mean_tpot_ms"),
        "itl_mean": dig(d, "mean_itl_ms"),
        "output_tok_s": dig(d, "output_throughput"),
    }


def guidellm_command(load: Load, out: Path, venv: Path | None) -> list[str]:
    backend = (
        f"kind=openai_http,target={load.url},model={MODEL},request_format=/v1/chat/completions"
    )
    data = f"kind=synthetic_text,prompt_tokens={load.prompt_tokens},output_tokens={load.max_tokens}"
    return [
        str(venv / "bin" / "guidellm"), "run", "--backend", backend,
        "--profile", f"kind=concurrent,streams={load.concurrency}",
        "--constraint", f"kind=max_requests,count={load.requests}",
        "--data", data, "--tokenizer", f"kind=huggingface_auto,model={load.tokenizer}",
        "--output", f"kind=json,path={out / 'benchmarks.json'}",
        "--disable-console-interactive",
    ]  # fmt: skip


def guidellm_parse(out: Path) -> dict[str, float | None]:
    """benchmarks[0].metrics.<metric>.<status>.<stat>; TPOT is its own (TTFT included)."""
    m = json.loads((out / "benchmarks.json").read_text())["benchmarks"][0]["metrics"]
    return {
        "ttft_mean": dig(m, "time_to_first_token_ms", "successful", "mean"),
        "ttft_median": dig(m, "time_to_first_token_ms", "successful", "median"),
        "tpot_mean": dig(m, "time_per_output_token_ms", "successful", "mean"),
        "itl_mean": dig(m, "inter_token_latency_ms", "successful", "mean"),
        # what its console prints as the server's output tokens per second
        "output_tok_s": dig(m, "output_tokens_per_second", "total", "mean"),
    }


def aiperf_command(load: Load, out: Path, venv: Path | None) -> list[str]:
    return [
        str(venv / "bin" / "aiperf"), "profile", "--model", MODEL, "--url", load.url,
        "--endpoint-type", "chat", "--streaming", "--tokenizer", str(load.tokenizer),
        "--isl", str(load.prompt_tokens), "--isl-stddev", "0",
        "--osl", str(load.max_tokens), "--osl-stddev", "0",
        "--extra-inputs", "ignore_eos:true", "--extra-inputs", f"min_tokens:{load.max_tokens}",
        "--concurrency", str(load.concurrency), "--request-count", str(load.requests),
        "--random-seed", "0", "--artifact-dir", str(out), "--ui-type", "none",
    ]  # fmt: skip


def aiperf_parse(out: Path) -> dict[str, float | None]:
    """profile_export_aiperf.json: <metric>.{avg,p50}; its ITL is per request (TPOT's formula)."""
    d = json.loads((out / "profile_export_aiperf.json").read_text())
    return {
        "ttft_mean": dig(d, "time_to_first_token", "avg"),
        "ttft_median": dig(d, "time_to_first_token", "p50"),
        "tpot_mean": None,  # not reported
        "itl_mean": dig(d, "inter_token_latency", "avg"),
        "output_tok_s": dig(d, "output_token_throughput", "avg"),
    }


def vllm_command(load: Load, out: Path, venv: Path | None) -> list[str]:
    return [
        str(venv / "bin" / "vllm"), "bench", "serve", "--backend", "openai-chat",
        "--base-url", load.url, "--endpoint", "/v1/chat/completions",
        "--model", MODEL, "--tokenizer", str(load.tokenizer),
        "--dataset-name", "random", "--random-input-len", str(load.prompt_tokens),
        "--random-output-len", str(load.max_tokens), "--random-range-ratio", "0",
        "--num-prompts", str(load.requests), "--max-concurrency", str(load.concurrency),
        "--request-rate", "inf", "--ignore-eos", "--seed", "0", "--disable-tqdm",
        "--save-result", "--result-dir", str(out), "--result-filename", "result.json",
    ]  # fmt: skip


def vllm_parse(out: Path) -> dict[str, float | None]:
    """vLLM's result JSON: the keys ours follows."""
    return ours_parse(out)


TOOLS: dict[str, tuple[str, Callable, Callable]] = {  # name: (endpoint, command, parse)
    "ours": ("/v1/chat/completions (stream)", ours_command, ours_parse),
    "guidellm": ("/v1/chat/completions (stream)", guidellm_command, guidellm_parse),
    "aiperf": ("/v1/chat/completions (stream)", aiperf_command, aiperf_parse),
    "vllm": ("/v1/chat/completions (stream)", vllm_command, vllm_parse),
}
LABELS = {
    "ours": "ours",
    "guidellm": "guidellm",
    "aiperf": "AIPerf",
    "vllm": "vllm bench serve",
}


def tool_env(tool: str) -> dict[str, str]:
    """The peers' environment: no hub, no telemetry."""
    env = {**os.environ, "DO_NOT_TRACK": "1", "VLLM_NO_USAGE_STATS": "1"}
    for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        env.pop(key, None)
    if tool != "aiperf":
        # AIPerf 0.13 in offline mode looks a tokenizer up in the hub cache even when it
        # is a local folder, and fails; it reads the local folder when not offline.
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    return env


def run_tool(tool: str, load: Load, out: Path, venv: Path | None) -> ToolRun:
    """Run one tool on one cell and parse its own result file."""
    endpoint, command, parse = TOOLS[tool]
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    run = ToolRun(tool, endpoint, command(load, out, venv))
    started = time.monotonic()
    try:
        with (out / "console.log").open("w") as log:
            done = subprocess.run(
                run.command,
                cwd=out if tool != "ours" else ROOT,
                env=tool_env(tool),
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=TOOL_TIMEOUT_S,
            )
        run.seconds = time.monotonic() - started
        if done.returncode != 0:
            tail = (out / "console.log").read_text().strip().splitlines()[-3:]
            run.error = f"exit {done.returncode}: {' | '.join(tail)[-300:]}"
        run.reported = parse(out)
    except subprocess.TimeoutExpired:
        run.error = f"timed out after {TOOL_TIMEOUT_S} s"
    except (OSError, ValueError, KeyError, IndexError, TypeError) as err:
        run.error = (run.error + "; " if run.error else "") + f"result unreadable: {err!r}"
    return run


# --- the race -------------------------------------------------------------------------------


def relative_error(reported: float | None, truth: float | None) -> float | None:
    """(reported - truth) / truth in percent."""
    if reported is None or truth is None or truth == 0:
        return None
    return (reported - truth) / truth * 100


def race(args: argparse.Namespace, venvs: dict[str, Path | None]) -> list[dict]:
    """Every configuration x concurrency x tool; a row per tool run with truth and errors."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-accuracy-") as tmp:
        model = make_model(Path(tmp) / "model")
        tokenizer = make_tokenizer(Path(tmp) / "tokenizer")
        for config, env in CONFIGS.items():
            sim = Simulator(model, env)
            try:
                for c in CONCURRENCY:
                    load = Load(sim.url, c, args.requests, PROMPT_TOKENS, MAX_TOKENS, tokenizer)
                    for tool in args.tools:
                        if tool != "ours" and venvs.get(tool) is None:
                            continue
                        slug = config.split()[0] + "tpc"
                        out = RUNS / slug / f"c{c}" / tool
                        print(f"{config}, C={c}: {LABELS[tool]} ...", flush=True)
                        sim.clear()
                        run = run_tool(tool, load, out, venvs.get(tool))
                        records = sim.truth()
                        (out / "server_truth.json").write_text(json.dumps(records) + "\n")
                        kept = measured(records, args.requests, MAX_TOKENS)
                        truth = truth_metrics(kept)
                        errors = {k: relative_error(run.reported.get(k), truth[k]) for k in METRICS}
                        rows.append({
                            "config": config,
                            "concurrency": c,
                            "tool": tool,
                            "endpoint": run.endpoint,
                            "command": run.command,
                            "error": run.error,
                            "seconds": round(run.seconds, 1),
                            "server_requests": len(records),
                            "measured_requests": len(kept),
                            "prompt_tokens": sorted({r["prompt_tokens"] for r in kept}),
                            "truth": truth,
                            "reported": run.reported,
                            "error_pct": errors,
                        })  # fmt: skip
                        print("  " + row_line(rows[-1]), flush=True)
            finally:
                sim.stop()
    return rows


def row_line(row: dict) -> str:
    """A progress line: each metric's error, or what went wrong."""
    parts = [f"{METRICS[k]} {fmt_pct(v)}" for k, v in row["error_pct"].items()]
    extra = f" [{row['error']}]" if row["error"] else ""
    return f"{row['measured_requests']} measured; " + ", ".join(parts) + extra


def fmt_pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:+.2f}%"


def markdown(rows: list[dict], notes: dict[str, str]) -> str:
    """The table: per configuration and concurrency, each tool's signed error per metric."""
    head = "| config | C | tool | " + " | ".join(METRICS.values()) + " | measured |"
    lines = [head, "|" + "---|" * (len(METRICS) + 4)]
    for row in rows:
        cells = [fmt_pct(row["error_pct"][k]) for k in METRICS]
        label = LABELS[row["tool"]] + (" (failed)" if row["error"] else "")
        lines.append(
            f"| {row['config']} | {row['concurrency']} | {label} | "
            + " | ".join(cells)
            + f" | {row['measured_requests']} |"
        )
    lines.append("")
    lines.append("Truth (server side) in the first tool run of each cell (ms, tok/s):")
    seen = set()
    for row in rows:
        key = (row["config"], row["concurrency"])
        if key in seen:
            continue
        seen.add(key)
        t = row["truth"]
        lines.append(
            f"- {key[0]}, C={key[1]}: "
            + ", ".join(f"{METRICS[k]} {v:.2f}" for k, v in t.items() if v is not None)
        )
    lines.append(
        "- TPOT is (last - first token) / (tokens - 1) in the truth; guidellm's own TPOT is"
        " latency / tokens (TTFT included); AIPerf reports no TPOT; its ITL is per request."
    )
    for tool, note in notes.items():
        lines.append(f"- {LABELS[tool]}: {note}")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    """Grouped bars of |error| % per metric, a bar per tool, a panel per config and C."""
    cells = list(dict.fromkeys((r["config"], r["concurrency"]) for r in rows))
    tools = list(dict.fromkeys(r["tool"] for r in rows))
    colors = {"ours": "#4c72b0", "guidellm": "#dd8452", "aiperf": "#55a868", "vllm": "#c44e52"}
    fig, axes = plt.subplots(len(cells), 1, figsize=(11, 3.2 * len(cells)), squeeze=False)
    width = 0.8 / max(1, len(tools))
    for ax, cell in zip(axes[:, 0], cells, strict=True):
        for i, tool in enumerate(tools):
            row = next((r for r in rows if (r["config"], r["concurrency"]) == cell
                        and r["tool"] == tool), None)  # fmt: skip
            if row is None:
                continue
            values = [row["error_pct"][k] for k in METRICS]
            xs = [j + (i - (len(tools) - 1) / 2) * width for j in range(len(METRICS))]
            heights = [max(abs(v), 0.01) if v is not None else 0 for v in values]
            bars = ax.bar(xs, heights, width, label=LABELS[tool], color=colors.get(tool))
            labels = ["n/a" if v is None else f"{abs(v):.1f}" for v in values]
            ax.bar_label(bars, labels=labels, fontsize=7, padding=1)
        ax.set_yscale("log")
        ax.axhline(2, color="black", linewidth=0.8, linestyle="--")
        ax.set_xticks(range(len(METRICS)), list(METRICS.values()))
        ax.set_ylabel("|error| % (log)")
        ax.set_title(f"{cell[0]}, concurrency {cell[1]} (dashed: 2%)")
        ax.set_ylim(top=ax.get_ylim()[1] * 4)  # room for the labels
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16, help="requests per tool and cell")
    parser.add_argument("--skip-install", action="store_true", help="use existing venvs only")
    parser.add_argument("--retry-install", action="store_true", help="retry failed installs")
    parser.add_argument("--tools", default=",".join(TOOLS), help="comma-separated subset")
    args = parser.parse_args()
    args.tools = [t for t in args.tools.split(",") if t]
    unknown = set(args.tools) - set(TOOLS)
    if unknown:
        parser.error(f"unknown tools: {', '.join(sorted(unknown))} (known: {', '.join(TOOLS)})")
    venvs: dict[str, Path | None] = {}
    notes: dict[str, str] = {}
    for tool in args.tools:
        if tool in PEERS:
            venvs[tool], how = ensure_venv(PEERS[tool], not args.skip_install, args.retry_install)
            notes[tool] = f"{' '.join(PEERS[tool].pins)}: {how}"
            print(f"{LABELS[tool]}: {notes[tool]}", flush=True)
    rows = race(args, venvs)
    OUT.mkdir(exist_ok=True)
    table = markdown(rows, notes)
    (OUT / "bench_accuracy.md").write_text(table)
    results = {"timing_model": CONFIGS, "prompt_tokens": PROMPT_TOKENS,
               "max_tokens": MAX_TOKENS, "requests": args.requests, "notes": notes,
               "rows": rows}  # fmt: skip
    (OUT / "bench_accuracy.json").write_text(json.dumps(results, indent=1) + "\n")
    if rows:
        plot(rows, OUT / "bench_accuracy.png")
    print()
    print(table)
    print(f"written: {OUT / 'bench_accuracy.md'}, .json, .png")
    return 1 if any(r["error"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
