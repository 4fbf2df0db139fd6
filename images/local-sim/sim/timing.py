"""The timing model (SIM_* env, the profile's `simulator:` section).

A request is admitted when fewer than SIM_MAX_RUNNING run (FIFO; the others wait:
vllm:num_requests_waiting); "admission" is the receipt itself when a slot is free. Its first
token is written SIM_TTFT_S + prompt_tokens / SIM_PREFILL_TOK_S after admission; each later
token follows 1 / (SIM_DECODE_TOK_S / c ** SIM_DECODE_FALLOFF) after the one before, c the
running count when that token's time is set; SIM_DECODE_JITTER=j draws each request's own pace,
a factor in [1 - j, 1 + j] on its token intervals (a noisy machine, run to run). Deadlines are
absolute (time.monotonic), so sleep jitter does not accumulate. The first token chunk carries
one token (prefill makes one); later chunks carry SIM_TOKENS_PER_CHUNK tokens (the last may
carry fewer), written at the deadline of their last token. SIM_EMPTY_CHUNKS=1 adds a
content-less chunk half a token after each token chunk but the last. The role-only first chunk
is written at admission, before the first token (current vLLM writes it with the first token
chunk; early here, so a client that times the role chunk as the first token is wrong by the
whole TTFT).
"""

from __future__ import annotations

import random
import time

from .settings import Settings


def first_token_at(admitted: float, prompt_tokens: int, s: Settings) -> float:
    """The time.monotonic() deadline of the first token: TTFT and prefill after admission."""
    return admitted + s.ttft_s + prompt_tokens / s.prefill_tok_s


def token_interval(running: int, s: Settings) -> float:
    """Seconds to the next token of one stream while `running` requests run."""
    return max(running, 1) ** s.decode_falloff / s.decode_tok_s


def request_pace(s: Settings) -> float:
    """One request's factor on its token intervals: 1, or drawn in [1 - j, 1 + j]."""
    return 1.0 + s.decode_jitter * random.uniform(-1.0, 1.0) if s.decode_jitter else 1.0


def sleep_until(deadline: float) -> None:
    """Sleep to an absolute time.monotonic() deadline."""
    while (left := deadline - time.monotonic()) > 0:
        time.sleep(left)


def chunk_sizes(n: int, per_chunk: int) -> list[int]:
    """Tokens per chunk: one from prefill, then per_chunk each, the last maybe fewer."""
    if n == 0:
        return []
    rest = n - 1
    return (
        [1] + [per_chunk] * (rest // per_chunk) + ([rest % per_chunk] if rest % per_chunk else [])
    )
