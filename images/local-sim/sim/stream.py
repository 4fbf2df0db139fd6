"""One request on its way: admission, paced chunks in vLLM's wire shapes, metrics and truth.

Truth: GET /sim/requests lists, per request (newest last, at most engine.TRUTH_KEPT), the first
PROMPT_HEAD characters of its prompt text, the wall-clock times (time.time(), taken when the
bytes were flushed to the socket) of receipt, admission, every chunk written as [time,
cumulative completion tokens, tokens in the chunk] (0 for the role, empty and usage-only
chunks), and finish; DELETE /sim/requests clears the list.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import TYPE_CHECKING, Protocol

from .prompt import Prompt, flag
from .reply import Piece, Reply
from .timing import chunk_sizes, first_token_at, request_pace, sleep_until

if TYPE_CHECKING:
    from .engine import Engine


class Client(Protocol):
    """What a stream needs of the request handler it answers through (handler.Handler), so
    that the handler imports the stream and not the other way round."""

    engine: Engine
    received_mono: float  # when the request arrived
    close_connection: bool

    def send_response(self, code: int) -> None: ...
    def send_header(self, keyword: str, value: str) -> None: ...
    def end_headers(self) -> None: ...
    def send_json(self, status: int, body: object) -> None: ...
    def write_chunk(self, data: bytes) -> float: ...


FINGERPRINT = "sparkforge-simulator"
PROMPT_HEAD = 64  # characters of each prompt kept in the truth: enough to tell nonces apart


class ClientGone(Exception):
    """The client closed the connection mid-stream."""


class Stream:
    """One request on its way: admission, paced chunks, the response, metrics and truth."""

    def __init__(self, h: Client, kind: str, body: dict, prompt: Prompt, reply: Reply,
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
            self.paced(first_token_at(admitted, self.prompt.tokens, s))
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
        pace = request_pace(s)
        for i, size in enumerate(sizes):
            if i > 0:
                half = engine.token_interval() * pace / 2
                if s.empty_chunks:
                    sleep_until(deadline + half)
                    if self.streaming:
                        self.emit(self.chunk([], None), 0)
                for k in range(size):
                    deadline += engine.token_interval() * pace
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
        engine.count_finished(reason)
