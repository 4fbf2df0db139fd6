"""Server-sent events of an OpenAI streaming chat completion, split and read as chunks.

One network read is not one event: bytes are buffered to the blank line that ends an event.
A chunk is not a token: what a chunk carries is read from its delta, and how many tokens it
brought from the cumulative `usage` that continuous usage stats put on every chunk.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

DONE = "[DONE]"
# A chunk is a few hundred bytes; an event past this is not one a server streams honestly, and
# buffering it further would cost memory and, split again on every read, quadratic time.
MAX_EVENT_BYTES = 1 << 20


class BadStream(Exception):
    """The stream is not server-sent events of chunks: the request fails with this reason."""


class EventBuffer:
    """Bytes in, complete `data:` payloads out (comments and other fields dropped)."""

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, data: bytes) -> list[str]:
        """The payloads of the events that data completes, in order."""
        # CRLF may straddle two reads: normalize the joined bytes, not each read.
        self._pending = (self._pending + data).replace(b"\r\n", b"\n")
        *complete, self._pending = self._pending.split(b"\n\n")
        if len(self._pending) > MAX_EVENT_BYTES:
            raise BadStream(f"an event longer than {MAX_EVENT_BYTES >> 20} MiB")
        payloads = []
        for event in complete:
            lines = [
                line[5:].removeprefix(b" ")
                for line in event.split(b"\n")
                if line.startswith(b"data:")
            ]
            if not lines:
                continue
            if sum(map(len, lines)) > MAX_EVENT_BYTES:
                raise BadStream(f"an event longer than {MAX_EVENT_BYTES >> 20} MiB")
            try:
                payloads.append(b"\n".join(lines).decode())
            except UnicodeDecodeError:
                raise BadStream("an event that is not UTF-8") from None
        return payloads

    @property
    def leftover(self) -> bytes:
        """Bytes of an event that never ended (a stream cut mid-event)."""
        return self._pending


@dataclass
class Chunk:
    """What one streamed chunk brought."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    error: str | None = None

    @property
    def carries_token(self) -> bool:
        """True when the chunk brings output (not the role-only first chunk, not usage-only)."""
        return bool(self.content or self.reasoning or self.tool_calls)


def read_chunk(payload: str) -> Chunk:
    """A chunk from one event's JSON; an error body (HTTP 200 or not) becomes Chunk.error."""
    try:
        body = json.loads(payload)
    except (ValueError, RecursionError):  # RecursionError: nested past json's own limit
        return Chunk(error=f"not JSON: {payload[:120]!r}")
    if not isinstance(body, dict):
        return Chunk(error=f"not a JSON object: {payload[:120]!r}")
    if "error" in body:
        error = body["error"]
        message = error.get("message", error) if isinstance(error, dict) else error
        return Chunk(error=str(message)[:300])
    usage, choices = body.get("usage"), body.get("choices") or []
    if usage is not None and not isinstance(usage, dict):
        return Chunk(error=f"usage: expected an object, got {type(usage).__name__}")
    if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
        return Chunk(error="choices: expected a list of objects")
    chunk = Chunk(usage=usage)
    for choice in choices:
        delta = choice.get("delta") or {}
        if not isinstance(delta, dict):
            return Chunk(error="choices[].delta: expected an object")
        # vLLM named it reasoning_content, then reasoning; SGLang says reasoning_content.
        texts = (delta.get("content"), delta.get("reasoning_content") or delta.get("reasoning"))
        calls, finish = delta.get("tool_calls") or [], choice.get("finish_reason")
        if not all(isinstance(t, str | None) for t in (*texts, finish)) or not isinstance(
            calls, list
        ):
            return Chunk(error="choices[]: content, reasoning or finish_reason not text")
        chunk.content += texts[0] or ""
        chunk.reasoning += texts[1] or ""
        chunk.tool_calls += calls
        chunk.finish_reason = finish or chunk.finish_reason
    return chunk
