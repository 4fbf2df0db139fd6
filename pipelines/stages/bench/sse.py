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


class EventBuffer:
    """Bytes in, complete `data:` payloads out (comments and other fields dropped)."""

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, data: bytes) -> list[str]:
        """The payloads of the events that data completes, in order."""
        # CRLF may straddle two reads: normalize the joined bytes, not each read.
        self._pending = (self._pending + data).replace(b"\r\n", b"\n")
        *complete, self._pending = self._pending.split(b"\n\n")
        payloads = []
        for event in complete:
            lines = [
                line[5:].removeprefix(b" ")
                for line in event.split(b"\n")
                if line.startswith(b"data:")
            ]
            if lines:
                payloads.append(b"\n".join(lines).decode())
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
    except json.JSONDecodeError:
        return Chunk(error=f"not JSON: {payload[:120]!r}")
    if not isinstance(body, dict):
        return Chunk(error=f"not a JSON object: {payload[:120]!r}")
    if "error" in body:
        error = body["error"]
        message = error.get("message", error) if isinstance(error, dict) else error
        return Chunk(error=str(message)[:300])
    chunk = Chunk(usage=body.get("usage"))
    for choice in body.get("choices") or []:
        delta = choice.get("delta") or {}
        chunk.content += delta.get("content") or ""
        # vLLM named it reasoning_content, then reasoning; SGLang says reasoning_content.
        chunk.reasoning += delta.get("reasoning_content") or delta.get("reasoning") or ""
        chunk.tool_calls += delta.get("tool_calls") or []
        chunk.finish_reason = choice.get("finish_reason") or chunk.finish_reason
    return chunk
