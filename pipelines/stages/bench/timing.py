"""The metric formulas, written out once (vLLM's names), over raw request records.

Token arrival times come from continuous usage: a chunk whose cumulative completion count
rises from a to b brought tokens a+1..b at its arrival time. Without continuous usage the
method falls back, and says so: the final usage spread evenly over the token-carrying chunks
("final-usage"), or, with no usage at all, one token per carrying chunk ("chunks").
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from dataclasses import dataclass

from pipelines.stages.bench.record import RequestRecord

CONTINUOUS = "continuous-usage"
FINAL_USAGE = "final-usage (estimated: no per-chunk usage; E2EL ends at the usage chunk)"
CHUNKS = "chunks (estimated: no usage at all)"
WINDOW = (129, 641)  # the decode window of one stream: tokens 129..641


@dataclass(frozen=True)
class Timing:
    """One request's timings: TTFT, end, tokens, TPOT, ITLs, token arrival times, method, and
    the time to first content (after any reasoning; None when no content came)."""

    ttft: float
    e2el: float
    output_tokens: int
    tpot: float | None
    itls: list[float]
    arrivals: list[float]
    method: str
    ttfc: float | None = None


def token_arrivals(record: RequestRecord) -> tuple[list[float], str]:
    """The arrival time of every output token of a request, and how it was found."""
    counted = [(e.t, e.tokens) for e in record.events if e.tokens is not None]
    if counted and all(e.tokens is not None for e in record.events if e.carries):
        arrivals: list[float] = []
        for t, tokens in counted:
            arrivals += [t] * max(0, tokens - len(arrivals))
        return arrivals, CONTINUOUS
    carrying = [e for e in record.events if e.carries]
    if record.completion_tokens and carrying:
        n, k = record.completion_tokens, len(carrying)
        # chunk i brings the tokens up to round(n * (i + 1) / k): n spread evenly over k.
        arrivals = []
        for i, event in enumerate(carrying):
            arrivals += [event.t] * (round(n * (i + 1) / k) - len(arrivals))
        return arrivals, FINAL_USAGE
    return [e.t for e in carrying], CHUNKS


def request_timing(record: RequestRecord) -> Timing | None:
    """A completed request's timings (None when it failed or brought no token).

    E2EL ends at the last token usage counts, not at the last visible chunk: a server sends
    tokens with no text (special tokens, part of a UTF-8 character) and usage counts them.
    Without per-chunk usage it ends at the final usage chunk, when one came after the text.
    """
    carrying = [e for e in record.events if e.carries]
    if not record.ok or not carrying:
        return None
    arrivals, method = token_arrivals(record)
    ttft, e2el = carrying[0].t, carrying[-1].t
    if method == CONTINUOUS and arrivals:
        ttft, e2el = min(ttft, arrivals[0]), arrivals[-1]
    elif method == FINAL_USAGE:
        e2el = max([e2el] + [e.t for e in record.events if e.tokens is not None])
    n = len(arrivals)
    tpot = (e2el - ttft) / (n - 1) if n > 1 else None
    ttfc = next((e.t for e in carrying if e.content), None)
    return Timing(ttft, e2el, n, tpot, inter_token_latencies(arrivals), arrivals, method, ttfc)


def inter_token_latencies(arrivals: list[float]) -> list[float]:
    """Gaps between token-bringing chunks, a gap that brought k tokens counted as k gaps / k."""
    itls: list[float] = []
    if not arrivals:
        return itls
    previous, i = arrivals[0], 1
    while i < len(arrivals) and arrivals[i] == previous:  # tokens of the first chunk: no gap
        i += 1
    while i < len(arrivals):
        t = arrivals[i]
        k = 1
        while i + k < len(arrivals) and arrivals[i + k] == t:
            k += 1
        itls += [(t - previous) / k] * k
        previous, i = t, i + k
    return itls


def window_rate(arrivals: list[float], window: tuple[int, int] = WINDOW) -> float | None:
    """Tokens first..last of one stream over the time between their arrivals (tok/s)."""
    first, last = window
    if len(arrivals) < last:
        return None
    span = arrivals[last - 1] - arrivals[first - 1]
    return (last - first) / span if span > 0 else None


def window_note(timings: list[Timing], measured: int) -> str | None:
    """Why no stream (or not every one) gave a decode window; None when all did."""
    if measured == len(timings):
        return None
    most = max((t.output_tokens for t in timings), default=0)
    first, last = WINDOW
    return (
        f"window measured on {measured} of {len(timings)} requests: it needs {last} output"
        f" tokens (tokens {first}..{last}), the longest brought {most}"
    )


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile with linear interpolation (numpy's default), q in 0..100."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low, high = math.floor(pos), math.ceil(pos)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def distribution(name: str, seconds: list[float]) -> dict[str, float | None]:
    """mean/median/std/p99 of a list of seconds, as vLLM's `<stat>_<name>_ms` keys."""
    if not seconds:
        return {f"{s}_{name}_ms": None for s in ("mean", "median", "std", "p99")}
    ms = [s * 1000 for s in seconds]
    return {
        f"mean_{name}_ms": statistics.fmean(ms),
        f"median_{name}_ms": statistics.median(ms),
        f"std_{name}_ms": statistics.pstdev(ms),
        f"p99_{name}_ms": percentile(ms, 99),
    }


def summarize(records: list[RequestRecord], duration: float) -> dict[str, object]:
    """A cell's results under vLLM's key names, plus the per-stream decode window."""
    timings = [t for t in map(request_timing, records) if t is not None]
    completed = len(timings)
    output = sum(t.output_tokens for t in timings)
    prompt = sum(r.prompt_tokens or 0 for r in records if r.ok)
    windows = [w for w in (window_rate(t.arrivals) for t in timings) if w is not None]
    methods = sorted({t.method for t in timings})
    summary: dict[str, object] = {
        "duration": duration,
        "completed": completed,
        "failed": len(records) - completed,
        "total_input_tokens": prompt,
        "total_output_tokens": output,
        "request_throughput": completed / duration if duration > 0 else None,
        "output_throughput": output / duration if duration > 0 else None,
        "total_token_throughput": (prompt + output) / duration if duration > 0 else None,
        **distribution("ttft", [t.ttft for t in timings]),
        # bench.md: the first answer text, after reasoning, is worth its own figure.
        **distribution("ttfc", [t.ttfc for t in timings if t.ttfc is not None]),
        **distribution("tpot", [t.tpot for t in timings if t.tpot is not None]),
        **distribution("itl", [x for t in timings for x in t.itls]),
        **distribution("e2el", [t.e2el for t in timings]),
        "median_window_tok_s": statistics.median(windows) if windows else None,
        "window_note": window_note(timings, len(windows)),
        "min_window_tok_s": min(windows) if windows else None,
        "window_tokens": list(WINDOW),
        "method": methods[0] if len(methods) == 1 else ", ".join(methods) or None,
        "errors": error_counts(records),
    }
    return summary


def steady_state(
    records: list[RequestRecord], concurrency: int | None = None
) -> dict[str, float | None]:
    """SGLang's steady state: last first-token to first finish; tokens arriving in it per s.

    With more requests than streams (closed loop), over the first wave: the first
    `concurrency` requests sent, when every stream decodes at once; tokens of later requests
    that arrive in that span count too.
    """
    timings = [(r, t) for r in records if (t := request_timing(r)) is not None]
    if concurrency and len(timings) > concurrency:
        wave = sorted(timings, key=lambda rt: rt[0].started)[:concurrency]
        start = max(r.started + t.ttft for r, t in wave)
        end = min(r.started + t.e2el for r, t in wave)
        return steady_over(timings, start, end)
    if len(timings) < 2:
        return {"steady_start": None, "steady_end": None, "steady_output_throughput": None}
    start = max(r.started + t.ttft for r, t in timings)
    end = min(r.started + t.e2el for r, t in timings)
    return steady_over(timings, start, end)


def steady_over(
    timings: list[tuple[RequestRecord, Timing]], start: float, end: float
) -> dict[str, float | None]:
    """The steady span's ends and the tokens per second that arrived within it."""
    if end <= start:
        return {"steady_start": start, "steady_end": end, "steady_output_throughput": None}
    tokens = sum(1 for r, t in timings for a in t.arrivals if start <= r.started + a <= end)
    return {
        "steady_start": start,
        "steady_end": end,
        "steady_output_throughput": tokens / (end - start),
    }


def error_counts(records: list[RequestRecord]) -> list[dict[str, object]]:
    """Each distinct failure reason with how many requests it failed, most first (up to 5)."""
    counts = Counter(r.error for r in records if r.error)
    return [{"reason": reason, "count": n} for reason, n in counts.most_common(5)]


def failure_reasons(summary: dict[str, object]) -> str:
    """The failures of a cell in a few words: `2x HTTP 404: ...; 1x timeout: ...`."""
    errors = summary.get("errors") or []
    assert isinstance(errors, list)
    return "; ".join(f"{e['count']}x {e['reason']}" for e in errors)
