"""Simulated runtime of the local profile: test equipment with vLLM's OpenAI API on the wire.

It is not an engine. It checks the staged model folder is complete, then answers like a vLLM
OpenAI server (shapes from vllm-project/vllm: chat_completion/protocol.py and serving.py,
serve/engine/protocol.py, generate/base/protocol.py, v1/metrics/loggers.py) with timing
from a model set in the profile, and keeps the server-side truth of every request.

Endpoints: GET /health, /version, /v1/models, /metrics, /sim/requests; POST
/v1/chat/completions, /v1/completions, /tokenize; DELETE /sim/requests. SIM_MISSING_ROUTES
(comma-separated, e.g. "/metrics,/tokenize") answers those 404, as a server without them does
(SGLang without --enable-metrics has no /metrics).

Tokenizer (exact rule): a token is a maximal run of characters that are not Unicode
White_Space (Rust's char::is_whitespace: U+0009-U+000D, U+0020, U+0085, U+00A0, U+1680,
U+2000-U+200A, U+2028, U+2029, U+202F, U+205F, U+3000). A chat prompt counts the tokens of
each message's text content (string, or the "text" parts of a list), summed; no template
tokens. Token ids: index in VOCAB, 0 ([UNK]) for any other word. Hugging Face's WordLevel
model with the WhitespaceSplit pre-tokenizer counts the same: `python3 server.py
--write-tokenizer DIR` writes that tokenizer.json (and a tokenizer_config.json).

Output (greedy, deterministic): words of OUTPUT_WORDS in order, one token each, joined by
single spaces. Known answers: "A+B" (also -, *, x) in a short last user message -> the
result; a RULER needle ("One of the special magic numbers for <key> is: <7 digits>.") in
the prompt whose <key> the last user message asks for -> the digits; a tool named (or its
name's words) in the last user message when `tools` are given -> a tool call. A known answer
ends with finish_reason "stop" ("tool_calls" for a tool call, as vLLM says for auto and
required tool choice). Otherwise exactly max_completion_tokens / max_tokens tokens, finish
"length"; with neither given, 64 tokens and "stop" (the model's own EOS). min_tokens pads an
answer with words; ignore_eos pads it to the limit (finish "length"). Thinking
(chat_template_kwargs thinking / enable_thinking, off by default) puts THINK_TOKENS
reasoning tokens first, streamed as `reasoning` (vLLM today) and `reasoning_content`
(older vLLM, SGLang); usage.completion_tokens counts them and
completion_tokens_details.reasoning_tokens names them.

Timing model (SIM_* env, the profile's `simulator:` section): a request is admitted when
fewer than SIM_MAX_RUNNING run (FIFO; the others wait: vllm:num_requests_waiting). Its first
token is written SIM_TTFT_S + prompt_tokens / SIM_PREFILL_TOK_S after admission; each later
token follows 1 / (SIM_DECODE_TOK_S / c ** SIM_DECODE_FALLOFF) after the one before, c the
running count when that token's time is set. Deadlines are absolute (time.monotonic), so
sleep jitter does not accumulate. The first token chunk carries one token (prefill makes
one); later chunks carry SIM_TOKENS_PER_CHUNK tokens (the last may carry fewer), written at
the deadline of their last token. SIM_EMPTY_CHUNKS=1 adds a content-less chunk half a token
after each token chunk but the last. The role-only first chunk is written at admission, before
the first token (current vLLM writes it with the first token chunk; early here, so a client
that times the role chunk as the first token is wrong by the whole TTFT).
"Admission" is the receipt itself when a slot is free. /metrics observes TTFT from receipt,
one inter-token latency per token chunk (per engine step, as vLLM does), and per request
(last token - first token) / (tokens - 1) as vllm:request_time_per_output_token_seconds.

Truth: GET /sim/requests lists, per request (newest last, at most 10000), the first
PROMPT_HEAD characters of its prompt text, the wall-clock times (time.time(), taken when the
bytes were flushed to the socket) of receipt, admission, every chunk written as [time,
cumulative completion tokens, tokens in the chunk] (0 for the role, empty and usage-only
chunks), and finish; DELETE /sim/requests clears the list.
"""

from __future__ import annotations

import json
import os
import re
import socket
import sys
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

VERSION = "0.0.0+sparkforge-simulator"
FINGERPRINT = "sparkforge-simulator"
UNK = "[UNK]"
OUTPUT_WORDS = (
    "the", "model", "runs", "on", "a", "ring", "of", "sparks", "and", "each", "node",
    "holds", "one", "shard", "while", "tokens", "stream", "through", "its", "decode",
    "step", "with", "cache", "memory", "for", "every", "layer", "in", "order", "as",
    "experts", "route", "their", "weights", "over", "links", "to", "next", "rank",
)  # fmt: skip
THINK_WORDS = ("let", "me", "think", "about", "this", "question", "carefully", "first")
VOCAB = (UNK, *dict.fromkeys(OUTPUT_WORDS + THINK_WORDS))
VOCAB_IDS = {word: i for i, word in enumerate(VOCAB)}
THINK_TOKENS = 16
NATURAL_TOKENS = 64  # reply length when the request sets no limit (the model's own EOS)
SHORT_QUESTION = 64  # arithmetic is answered only in a last user message this short
TRUTH_KEPT = 10000
PROMPT_HEAD = 64  # characters of each prompt kept in the truth: enough to tell nonces apart

WHITESPACE = "\t\n\v\f\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
SPLIT = re.compile(f"[{WHITESPACE}]+")
ARITHMETIC = re.compile(r"(-?\d+)\s*([-+*x×])\s*(-?\d+)")
NEEDLE = re.compile(r"One of the special magic numbers for (.+?) is: (\d{7})\.")
PLACE = re.compile(r"\b(?:in|for|at|of|about|near)\s+([A-Z][\w'-]*(?:\s+[A-Z][\w'-]*)*)")

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                   50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


def tokenize(text: str) -> list[str]:
    """The tokens of a text: runs of non-whitespace characters."""
    return [t for t in SPLIT.split(text) if t]


def token_ids(words: list[str]) -> list[int]:
    """Vocabulary ids of tokens ([UNK] = 0 for words outside VOCAB)."""
    return [VOCAB_IDS.get(w, 0) for w in words]


def tokenizer_json() -> dict:
    """A Hugging Face tokenizer.json (WordLevel + WhitespaceSplit) that counts as the server."""
    # No added tokens: a literal "[UNK]" in a text is a word like any other, as here.
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": VOCAB_IDS, "unk_token": UNK},
    }


def write_tokenizer(folder: Path, max_model_len: int) -> None:
    """tokenizer.json and tokenizer_config.json for peer harnesses (no model hub here)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer_json(), indent=1) + "\n")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": UNK,
        "model_max_length": max_model_len,
        # Contents joined by newlines: the same token count as the server's chat prompt.
        "chat_template": "{% for m in messages %}{{ m['content'] }}\n{% endfor %}",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")


@dataclass(frozen=True)
class Settings:
    """The timing model and identity, from SIM_* env."""

    model_dir: Path
    served_name: str
    max_model_len: int
    max_running: int
    ttft_s: float
    prefill_tok_s: float
    decode_tok_s: float
    decode_falloff: float
    tokens_per_chunk: int
    empty_chunks: bool
    host: str
    port: int
    missing_routes: frozenset[str] = frozenset()

    @classmethod
    def from_env(cls, env: dict[str, str]) -> Settings:
        """Settings from the environment, with the profile's defaults."""
        return cls(
            model_dir=Path(env.get("SIM_MODEL_DIR", "/models")),
            served_name=env.get("SIM_SERVED_MODEL_NAME", "simulated"),
            max_model_len=int(env.get("SIM_MAX_MODEL_LEN", "131072")),
            max_running=max(1, int(env.get("SIM_MAX_RUNNING", "8"))),
            ttft_s=float(env.get("SIM_TTFT_S", "0.05")),
            prefill_tok_s=float(env.get("SIM_PREFILL_TOK_S", "20000")),
            decode_tok_s=float(env.get("SIM_DECODE_TOK_S", "200")),
            decode_falloff=float(env.get("SIM_DECODE_FALLOFF", "0")),
            tokens_per_chunk=max(1, int(env.get("SIM_TOKENS_PER_CHUNK", "1"))),
            empty_chunks=env.get("SIM_EMPTY_CHUNKS", "0").lower() in ("1", "true", "yes"),
            host=env.get("SIM_HOST", "127.0.0.1"),
            port=int(env.get("SIM_PORT", "8000")),
            missing_routes=frozenset(
                r.strip() for r in env.get("SIM_MISSING_ROUTES", "").split(",") if r.strip()
            ),
        )


def missing_model_files(folder: Path) -> list[str]:
    """What keeps the model folder from being complete: config.json and every indexed shard."""
    missing = []
    config = folder / "config.json"
    try:
        json.loads(config.read_text())
    except (OSError, ValueError):
        missing.append("config.json")
    try:
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        shards = sorted(set(index["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return [*missing, "model.safetensors.index.json (with a weight_map)"]
    for name in shards:
        path = folder / name
        if not path.is_file() or path.stat().st_size == 0:
            missing.append(name if not path.is_file() else f"{name} (empty)")
    return missing


# --- requests: what to answer ---------------------------------------------------------------


class BadRequest(Exception):
    """A request vLLM would refuse: HTTP status, message, error type."""

    def __init__(self, message: str, status: int = 400, kind: str = "BadRequestError"):
        super().__init__(message)
        self.status = status
        self.kind = kind


def text_of(content: object) -> str:
    """The text of a message's content (a string or a list of parts)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"
        )
    raise BadRequest("message content must be a string or a list of parts")


@dataclass
class Prompt:
    """A request's prompt as the simulator reads it."""

    tokens: int
    texts: list[str]  # every message's text, in order
    last_user: str


def chat_prompt(messages: object) -> Prompt:
    """The prompt of a chat request."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list")
    texts, last_user = [], ""
    for m in messages:
        if not isinstance(m, dict) or "role" not in m:
            raise BadRequest("each message needs a 'role'")
        text = text_of(m.get("content"))
        texts.append(text)
        if m["role"] == "user":
            last_user = text
    return Prompt(sum(len(tokenize(t)) for t in texts), texts, last_user)


def arithmetic_answer(question: str) -> str | None:
    """ "19+23" -> "42", in a short question only."""
    if len(tokenize(question)) > SHORT_QUESTION:
        return None
    m = ARITHMETIC.search(question)
    if not m:
        return None
    a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
    return str(a + b if op == "+" else a - b if op == "-" else a * b)


def needle_answer(texts: list[str], question: str) -> str | None:
    """The 7-digit value(s) of the needle whose key the question names."""
    values: dict[str, list[str]] = {}
    for text in texts:
        for key, value in NEEDLE.findall(text):
            values.setdefault(key.strip(), []).append(value)
    if not values:
        return None
    asked = NEEDLE.sub(" ", question)
    keys = [k for k in values if k in asked]
    if not keys:
        return None
    return ", ".join(values[max(keys, key=len)])


def tool_named(tools: list[dict], choice: object, question: str) -> dict | None:
    """The function the request calls: the named one, or the one the question mentions."""
    functions = [t.get("function", {}) for t in tools if isinstance(t, dict)]
    functions = [f for f in functions if isinstance(f, dict) and f.get("name")]
    if not functions or choice == "none":
        return None
    if isinstance(choice, dict):
        name = choice.get("function", {}).get("name")
        return next((f for f in functions if f["name"] == name), None)
    low = question.lower()
    for f in functions:
        words = [w for w in re.split(r"[_\W]+", f["name"].lower()) if w and w not in ("get", "set")]
        if f["name"].lower() in low or (words and all(w in low for w in words)):
            return f
    return functions[0] if choice == "required" else None


def tool_arguments(function: dict, question: str) -> str:
    """JSON arguments for a call: each required (or every) parameter, from the question."""
    params = function.get("parameters") or {}
    props = params.get("properties") or {}
    names = params.get("required") or list(props)
    place = PLACE.search(question)
    words = " ".join(tokenize(place.group(1))) if place else "unknown"
    args: dict[str, object] = {}
    for name in names:
        spec = props.get(name, {})
        kind = spec.get("type", "string")
        if spec.get("enum"):
            args[name] = spec["enum"][0]
        elif kind in ("integer", "number"):
            args[name] = 0
        elif kind == "boolean":
            args[name] = False
        else:
            args[name] = words
    return json.dumps(args)


@dataclass
class Piece:
    """One output token: its kind (reasoning, content, tool_name, tool_args) and its text."""

    kind: str
    text: str


@dataclass
class Reply:
    """What the simulated model writes for a request."""

    pieces: list[Piece]
    finish_reason: str
    tool_name: str | None = None
    tool_id: str | None = None

    @property
    def reasoning_tokens(self) -> int:
        return sum(p.kind == "reasoning" for p in self.pieces)


def words_from(source: tuple[str, ...], n: int, kind: str) -> list[Piece]:
    """n tokens of a fixed word list, space-separated, as pieces of one kind."""
    return [Piece(kind, ("" if i == 0 else " ") + source[i % len(source)]) for i in range(n)]


def flag(value: object) -> bool:
    """A request flag given as a bool (or a bool-like string)."""
    return value is True or (isinstance(value, str) and value.lower() in ("true", "1"))


def plan_reply(body: dict, prompt: Prompt, max_model_len: int) -> Reply:
    """The reply's tokens and finish reason: the whole simulated model, greedy."""
    limit = body.get("max_completion_tokens") or body.get("max_tokens")
    room = max_model_len - prompt.tokens
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise BadRequest(f"max_tokens must be at least 1, got {limit}.")
    if limit is not None and limit > room:
        raise BadRequest(
            f"This model's maximum context length is {max_model_len} tokens. However, you"
            f" requested {limit} output tokens and your prompt contains at least"
            f" {prompt.tokens} input tokens, for a total of at least {prompt.tokens + limit}"
            " tokens. Please reduce the length of the input prompt or the number of requested"
            " output tokens."
        )
    min_tokens = int(body.get("min_tokens") or 0)
    ignore_eos = flag(body.get("ignore_eos"))
    kwargs = body.get("chat_template_kwargs") or {}
    thinking = flag(kwargs.get("thinking")) or flag(kwargs.get("enable_thinking"))

    pieces = words_from(THINK_WORDS, THINK_TOKENS, "reasoning") if thinking else []
    tools = body.get("tools") or []
    function = tool_named(tools, body.get("tool_choice", "auto"), prompt.last_user)
    if function:
        args = tokenize(tool_arguments(function, prompt.last_user))
        pieces += [Piece("tool_name", function["name"])]
        pieces += [Piece("tool_args", ("" if i == 0 else " ") + w) for i, w in enumerate(args)]
        named = isinstance(body.get("tool_choice"), dict)
        reply = Reply(pieces, "stop" if named else "tool_calls", function["name"])
        reply.tool_id = f"chatcmpl-tool-{uuid.uuid4().hex}"
        if limit is not None and len(pieces) > limit:
            return Reply(pieces[:limit], "length", reply.tool_name, reply.tool_id)
        return reply

    answer = needle_answer(prompt.texts, prompt.last_user) or arithmetic_answer(prompt.last_user)
    if answer is None:
        n = limit if limit is not None else room if ignore_eos else max(NATURAL_TOKENS, min_tokens)
        n = max(n - len(pieces), 0)
        pieces += words_from(OUTPUT_WORDS, n, "content")
        finish = "stop" if limit is None and not ignore_eos else "length"
        return Reply(pieces[: limit or len(pieces)], finish)
    pieces += words_from(tuple(tokenize(answer)), len(tokenize(answer)), "content")
    pad_to = (limit if limit is not None else room) if ignore_eos else min_tokens
    if len(pieces) < pad_to:
        pad = words_from(OUTPUT_WORDS, pad_to - len(pieces), "content")
        pieces += [Piece(p.kind, " " + p.text.lstrip()) for p in pad]
    if limit is not None and len(pieces) >= limit and (ignore_eos or len(pieces) > limit):
        return Reply(pieces[:limit], "length")
    return Reply(pieces, "stop")


# --- the engine: admission, pacing, metrics, truth -----------------------------------------


class Histogram:
    """A Prometheus histogram: cumulative buckets, count and sum."""

    def __init__(self, name: str, doc: str, buckets: tuple[float, ...]):
        self.name, self.doc, self.buckets = name, doc, buckets
        self.counts = [0] * len(buckets)
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
        self.count += 1
        self.sum += value

    def render(self, labels: str) -> list[str]:
        lines = [f"# HELP {self.name} {self.doc}", f"# TYPE {self.name} histogram"]
        for bound, n in zip(self.buckets, self.counts, strict=True):
            lines.append(f'{self.name}_bucket{{{labels},le="{float(bound)}"}} {float(n)}')
        lines.append(f'{self.name}_bucket{{{labels},le="+Inf"}} {float(self.count)}')
        lines.append(f"{self.name}_count{{{labels}}} {float(self.count)}")
        lines.append(f"{self.name}_sum{{{labels}}} {self.sum}")
        return lines


@dataclass
class Engine:
    """Admission (FIFO beyond max_running), the decode rate, metrics and the truth list."""

    settings: Settings
    cond: threading.Condition = field(default_factory=threading.Condition)
    running: int = 0
    queue: deque = field(default_factory=deque)
    truth: deque = field(default_factory=lambda: deque(maxlen=TRUTH_KEPT))
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: dict = field(default_factory=lambda: {"stop": 0, "length": 0, "abort": 0})
    histograms: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        h = [
            ("ttft", "vllm:time_to_first_token_seconds",
             "Histogram of time to first token in seconds.", TTFT_BUCKETS),
            ("itl", "vllm:inter_token_latency_seconds",
             "Histogram of inter-token latency in seconds.", ITL_BUCKETS),
            ("tpot", "vllm:request_time_per_output_token_seconds",
             "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS),
            ("e2e", "vllm:e2e_request_latency_seconds",
             "Histogram of e2e request latency in seconds.", LATENCY_BUCKETS),
            ("queue", "vllm:request_queue_time_seconds",
             "Histogram of time spent in WAITING phase for request.", LATENCY_BUCKETS),
        ]  # fmt: skip
        self.histograms = {key: Histogram(name, doc, b) for key, name, doc, b in h}

    def admit(self) -> bool:
        """Wait for a running slot, first come first served; True when it had to wait."""
        ticket = object()
        with self.cond:
            # It waits for a slot only when running and queued-before-it fill them all.
            waited = self.running + len(self.queue) >= self.settings.max_running
            self.queue.append(ticket)
            while self.queue[0] is not ticket or self.running >= self.settings.max_running:
                self.cond.wait()
            self.queue.popleft()
            self.running += 1
            self.cond.notify_all()
        return waited

    def release(self) -> None:
        with self.cond:
            self.running -= 1
            self.cond.notify_all()

    def token_interval(self) -> float:
        """Seconds to the next token of one stream, with the running count now."""
        s = self.settings
        return max(self.running, 1) ** s.decode_falloff / s.decode_tok_s

    def observe(self, key: str, value: float) -> None:
        with self.cond:
            self.histograms[key].observe(value)

    def count_tokens(self, prompt: int = 0, generated: int = 0) -> None:
        with self.cond:
            self.prompt_tokens += prompt
            self.generation_tokens += generated

    def metrics(self) -> str:
        """Prometheus text, vLLM's names and labels."""
        labels = f'model_name="{self.settings.served_name}",engine="0"'
        with self.cond:
            lines = [
                "# HELP vllm:num_requests_running Number of requests in model execution batches.",
                "# TYPE vllm:num_requests_running gauge",
                f"vllm:num_requests_running{{{labels}}} {float(self.running)}",
                "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
                "# TYPE vllm:num_requests_waiting gauge",
                f"vllm:num_requests_waiting{{{labels}}} {float(len(self.queue))}",
                "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
                "# TYPE vllm:kv_cache_usage_perc gauge",
                f"vllm:kv_cache_usage_perc{{{labels}}} 0.0",
                "# HELP vllm:prompt_tokens_total Number of prefill tokens processed.",
                "# TYPE vllm:prompt_tokens_total counter",
                f"vllm:prompt_tokens_total{{{labels}}} {float(self.prompt_tokens)}",
                "# HELP vllm:generation_tokens_total Number of generation tokens processed.",
                "# TYPE vllm:generation_tokens_total counter",
                f"vllm:generation_tokens_total{{{labels}}} {float(self.generation_tokens)}",
                "# HELP vllm:request_success_total Count of successfully processed requests.",
                "# TYPE vllm:request_success_total counter",
            ]
            for reason, n in self.finished.items():
                lines.append(
                    f'vllm:request_success_total{{{labels},finished_reason="{reason}"}} {float(n)}'
                )
            for h in self.histograms.values():
                lines += h.render(labels)
        return "\n".join(lines) + "\n"


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


# --- HTTP ---------------------------------------------------------------------------------


class ClientGone(Exception):
    """The client closed the connection mid-stream."""


class Handler(BaseHTTPRequestHandler):
    """vLLM's OpenAI routes over HTTP/1.1: keep-alive, streams in chunked encoding."""

    protocol_version = "HTTP/1.1"
    server_version = "uvicorn"
    sys_version = ""
    engine: Engine

    def setup(self) -> None:
        super().setup()
        # Small SSE writes must leave at once (Nagle would hold them for the peer's ACK).
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, format: str, *args: object) -> None:
        pass

    # plumbing

    def send_body(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def send_json(self, status: int, body: object) -> None:
        self.send_body(status, json.dumps(body, separators=(",", ":")).encode(), "application/json")

    def send_error_json(self, err: BadRequest) -> None:
        body = {"error": {"message": str(err), "type": err.kind, "param": None, "code": err.status}}
        self.send_json(err.status, body)

    def read_json(self) -> dict:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            body = json.loads(raw or b"null")
        except ValueError as err:
            raise BadRequest(f"invalid JSON body: {err}") from None
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        return body

    def write_chunk(self, data: bytes) -> float:
        """One HTTP chunk, flushed; returns the wall-clock time it left."""
        try:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()
        except OSError as err:
            raise ClientGone from err
        return time.time()

    # routes

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        s = self.engine.settings
        if path in s.missing_routes:
            self.send_json(404, {"detail": "Not Found"})
        elif path == "/health":
            self.send_body(200, b"", "application/json")
        elif path == "/version":
            self.send_json(200, {"version": VERSION})
        elif path == "/v1/models":
            card = {
                "id": s.served_name,
                "object": "model",
                "created": int(time.time()),
                "owned_by": "vllm",
                "root": str(s.model_dir),
                "parent": None,
                "max_model_len": s.max_model_len,
                "permission": [],
            }
            self.send_json(200, {"object": "list", "data": [card]})
        elif path == "/metrics":
            self.send_body(200, self.engine.metrics().encode(), "text/plain; version=0.0.4")
        elif path == "/sim/requests":
            with self.engine.cond:
                records = list(self.engine.truth)
            self.send_json(200, records)
        else:
            self.send_json(404, {"detail": "Not Found"})

    def do_DELETE(self) -> None:
        if self.path.split("?", 1)[0] != "/sim/requests":
            self.send_json(404, {"detail": "Not Found"})
            return
        with self.engine.cond:
            n = len(self.engine.truth)
            self.engine.truth.clear()
        self.send_json(200, {"cleared": n})

    def do_POST(self) -> None:
        received = time.time()
        self.received_mono = time.monotonic()
        path = self.path.split("?", 1)[0]
        routes = {
            "/v1/chat/completions": "chat",
            "/v1/completions": "text",
            "/tokenize": "tokenize",
        }
        try:
            body = self.read_json()
            if path not in routes or path in self.engine.settings.missing_routes:
                self.send_json(404, {"detail": "Not Found"})
            elif routes[path] == "tokenize":
                self.tokenize(body)
            else:
                self.complete(routes[path], body, received)
        except BadRequest as err:
            self.send_error_json(err)

    def tokenize(self, body: dict) -> None:
        if "messages" in body:
            words = [w for t in chat_prompt(body["messages"]).texts for w in tokenize(t)]
        elif isinstance(body.get("prompt"), str):
            words = tokenize(body["prompt"])
        else:
            raise BadRequest("give 'prompt' (a string) or 'messages'")
        out = {
            "count": len(words),
            "max_model_len": self.engine.settings.max_model_len,
            "tokens": token_ids(words),
            "token_strs": words if flag(body.get("return_token_strs")) else None,
        }
        self.send_json(200, out)

    def complete(self, kind: str, body: dict, received: float) -> None:
        s = self.engine.settings
        model = body.get("model")
        if model not in (None, s.served_name):
            raise BadRequest(f"The model `{model}` does not exist.", 404, "NotFoundError")
        if body.get("stream_options") and not flag(body.get("stream")):
            raise BadRequest("Stream options can only be defined when `stream=True`.")
        if (body.get("n") or 1) != 1:
            raise BadRequest("the simulator serves n=1 only")
        if kind == "chat":
            prompt = chat_prompt(body.get("messages"))
        else:
            text = body.get("prompt")
            if not isinstance(text, str):
                raise BadRequest("'prompt' must be a string")
            prompt = Prompt(len(tokenize(text)), [text], text)
            body = {k: v for k, v in body.items() if k not in ("tools", "chat_template_kwargs")}
        if prompt.tokens >= s.max_model_len:
            raise BadRequest(
                f"This model's maximum context length is {s.max_model_len} tokens. However,"
                f" your request has {prompt.tokens} input tokens. Please reduce the length of"
                " the input messages."
            )
        reply = plan_reply(body, prompt, s.max_model_len)
        Stream(self, kind, body, prompt, reply, received).run()


class Stream:
    """One request on its way: admission, paced chunks, the response, metrics and truth."""

    def __init__(self, h: Handler, kind: str, body: dict, prompt: Prompt, reply: Reply,
                 received: float):  # fmt: skip
        self.h, self.kind, self.prompt, self.reply = h, kind, prompt, reply
        self.engine = h.engine
        self.received_mono = h.received_mono
        self.streaming = flag(body.get("stream"))
        options = body.get("stream_options") or {}
        self.include_usage = flag(options.get("include_usage"))
        self.continuous = flag(options.get("continuous_usage_stats"))
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(received)
        self.tokens = 0
        self.record = {
            "id": self.id,
            "endpoint": kind,
            "prompt_head": "\n".join(prompt.texts)[:PROMPT_HEAD],
            "stream": self.streaming,
            "prompt_tokens": prompt.tokens,
            "completion_tokens": 0,
            "reasoning_tokens": reply.reasoning_tokens,
            "finish_reason": None,
            "received": received,
            "admitted": None,
            "chunks": [],
            "finished": None,
            "status": "waiting",
        }
        with self.engine.cond:
            self.engine.truth.append(self.record)

    # shapes

    def usage(self, final: bool = False) -> dict:
        u = {
            "prompt_tokens": self.prompt.tokens,
            "total_tokens": self.prompt.tokens + self.tokens,
            "completion_tokens": self.tokens,
        }
        if final and self.kind == "chat":
            done = sum(p.kind == "reasoning" for p in self.reply.pieces[: self.tokens])
            u["completion_tokens_details"] = {"reasoning_tokens": done}
        return u

    def delta(self, pieces: list[Piece], first_tool: bool) -> dict:
        """A chat delta carrying pieces (vLLM's DeltaMessage, plus reasoning_content)."""
        d: dict = {}
        reasoning = "".join(p.text for p in pieces if p.kind == "reasoning")
        content = "".join(p.text for p in pieces if p.kind == "content")
        if reasoning:
            d["reasoning"] = reasoning
            d["reasoning_content"] = reasoning
        if content:
            d["content"] = content
        if any(p.kind.startswith("tool") for p in pieces):
            args = "".join(p.text for p in pieces if p.kind == "tool_args")
            call: dict = {"index": 0, "function": {"arguments": args}}
            if first_tool:
                call = {"id": self.reply.tool_id, "type": "function", "index": 0,
                        "function": {"name": self.reply.tool_name, "arguments": args}}  # fmt: skip
            d["tool_calls"] = [call]
        return d

    def chunk(self, pieces: list[Piece] | None, finish: str | None, first_tool: bool = False,
              role: bool = False) -> bytes:  # fmt: skip
        if self.kind == "chat":
            delta = (
                {"role": "assistant", "content": ""}
                if role
                else (self.delta(pieces or [], first_tool) or {"content": ""})
            )
            choice: dict = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            obj = "chat.completion.chunk"
        else:
            text = "".join(p.text for p in pieces or [])
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            obj = "text_completion"
        if finish is not None:
            choice["stop_reason"] = None
        out = {"id": self.id, "object": obj, "created": self.created,
               "model": self.engine.settings.served_name, "choices": [choice]}  # fmt: skip
        if self.continuous:
            out["usage"] = self.usage()
        return b"data: " + json.dumps(out, separators=(",", ":")).encode() + b"\n\n"

    def final_usage_chunk(self) -> bytes:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        out = {"id": self.id, "object": obj, "created": self.created,
               "model": self.engine.settings.served_name, "choices": [],
               "usage": self.usage(final=True), "system_fingerprint": FINGERPRINT}  # fmt: skip
        return b"data: " + json.dumps(out, separators=(",", ":")).encode() + b"\n\n"

    def response(self) -> dict:
        pieces = self.reply.pieces
        finish = self.reply.finish_reason
        if self.kind == "text":
            choice = {"index": 0, "text": "".join(p.text for p in pieces), "logprobs": None,
                      "finish_reason": finish, "stop_reason": None}  # fmt: skip
            obj = "text_completion"
        else:
            reasoning = "".join(p.text for p in pieces if p.kind == "reasoning") or None
            content = "".join(p.text for p in pieces if p.kind == "content")
            message: dict = {"role": "assistant", "content": content, "refusal": None,
                             "annotations": None, "audio": None, "function_call": None,
                             "reasoning": reasoning, "reasoning_content": reasoning}  # fmt: skip
            if self.reply.tool_name:
                args = "".join(p.text for p in pieces if p.kind == "tool_args")
                message["content"] = content or None
                message["tool_calls"] = [{"id": self.reply.tool_id, "type": "function",
                                          "function": {"name": self.reply.tool_name,
                                                       "arguments": args}}]  # fmt: skip
            choice = {"index": 0, "message": message, "logprobs": None,
                      "finish_reason": finish, "stop_reason": None}  # fmt: skip
            obj = "chat.completion"
        return {"id": self.id, "object": obj, "created": self.created,
                "model": self.engine.settings.served_name, "choices": [choice],
                "service_tier": None, "system_fingerprint": FINGERPRINT,
                "usage": self.usage(final=True), "prompt_logprobs": None,
                "kv_transfer_params": None}  # fmt: skip

    # the run

    def note_chunk(self, at: float, n: int) -> None:
        self.record["chunks"].append([at, self.tokens, n])

    def emit(self, data: bytes, n: int) -> None:
        """Write a chunk (streaming) and record when it left (or would have)."""
        at = self.h.write_chunk(data) if self.streaming else time.time()
        self.note_chunk(at, n)

    def run(self) -> None:
        h, engine, s = self.h, self.engine, self.engine.settings
        if self.streaming:
            h.send_response(200)
            h.send_header("Content-Type", "text/event-stream; charset=utf-8")
            h.send_header("Transfer-Encoding", "chunked")
            h.end_headers()
        holds_slot = False
        try:
            # Prefill starts at receipt when a slot is free, else when one frees up.
            waited = engine.admit()
            holds_slot = True
            admitted = time.monotonic() if waited else self.received_mono
            admitted_wall = time.time() if waited else self.record["received"]
            self.record.update(admitted=admitted_wall, status="running")
            engine.observe("queue", admitted_wall - self.record["received"])
            if self.streaming and self.kind == "chat":
                self.emit(self.chunk(None, None, role=True), 0)
            self.paced(admitted + s.ttft_s + self.prompt.tokens / s.prefill_tok_s)
            if self.streaming:
                if self.include_usage:
                    self.emit(self.final_usage_chunk(), 0)
                h.write_chunk(b"data: [DONE]\n\n")
            # Done (truth, metrics, slot) before the body's last bytes leave: a client that
            # reads /sim/requests or /metrics the moment its response ends sees it finished.
            self.finish("ok", self.reply.finish_reason)
            engine.release()
            holds_slot = False
            if self.streaming:
                h.write_chunk(b"")
            else:
                h.send_json(200, self.response())
        except ClientGone:
            h.close_connection = True
            if self.record["finished"] is None:
                self.finish("aborted", "abort")
        finally:
            if holds_slot:
                engine.release()

    def paced(self, first_deadline: float) -> None:
        """Write the token chunks at their deadlines (the timing model)."""
        engine, s = self.engine, self.engine.settings
        pieces = self.reply.pieces
        sizes = chunk_sizes(len(pieces), s.tokens_per_chunk)
        deadline = first_deadline
        last_chunk_at = None
        for i, size in enumerate(sizes):
            if i > 0:
                half = engine.token_interval() / 2
                if s.empty_chunks:
                    sleep_until(deadline + half)
                    if self.streaming:
                        self.emit(self.chunk([], None), 0)
                for k in range(size):
                    deadline += engine.token_interval()
                    if k < size - 1:
                        sleep_until(deadline)
            sleep_until(deadline)
            start = self.tokens
            self.tokens += size
            part = pieces[start : self.tokens]
            finish = self.reply.finish_reason if self.tokens == len(pieces) else None
            first_tool = any(p.kind == "tool_name" for p in part)
            if self.streaming:
                self.emit(self.chunk(part, finish, first_tool), size)
            else:
                self.note_chunk(time.time(), size)
            at = self.record["chunks"][-1][0]
            self.record["completion_tokens"] = self.tokens
            if i == 0:
                engine.observe("ttft", at - self.record["received"])
                engine.count_tokens(prompt=self.prompt.tokens)
            else:
                engine.observe("itl", at - last_chunk_at)
            engine.count_tokens(generated=size)
            last_chunk_at = at

    def finish(self, status: str, reason: str) -> None:
        now = time.time()
        self.record.update(finished=now, status=status, finish_reason=reason)
        engine = self.engine
        engine.observe("e2e", now - self.record["received"])
        chunks = [c for c in self.record["chunks"] if c[2]]
        if status == "ok" and self.tokens > 1:
            engine.observe("tpot", (chunks[-1][0] - chunks[0][0]) / (self.tokens - 1))
        with engine.cond:
            engine.finished[reason if reason in engine.finished else "stop"] += 1


class Server(ThreadingHTTPServer):
    """Threads per connection, a deep accept backlog (eight streams connect at once)."""

    daemon_threads = True
    request_queue_size = 256


def main(argv: list[str]) -> None:
    settings = Settings.from_env(dict(os.environ))
    if len(argv) == 2 and argv[0] == "--write-tokenizer":
        write_tokenizer(Path(argv[1]), settings.max_model_len)
        return
    missing = missing_model_files(settings.model_dir)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        sys.exit(f"simulator: model folder {settings.model_dir} incomplete: {missing[0]}{more}")
    Handler.engine = Engine(settings)
    # A thread whose token is due must not wait 5 ms (the default) for another's GIL slice.
    sys.setswitchinterval(0.0005)
    server = Server((settings.host, settings.port), Handler)
    print(
        f"simulator: serving {settings.served_name} from {settings.model_dir} on"
        f" {settings.host}:{server.server_address[1]}",
        file=sys.stderr,
        flush=True,
    )
    server.serve_forever()


if __name__ == "__main__":
    main(sys.argv[1:])
