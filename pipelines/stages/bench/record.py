"""What one benchmark request saw, kept raw: each chunk's arrival time and token count."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Event:
    """One streamed chunk as it arrived: seconds after the request started, and what it held.

    tokens is the cumulative completion token count the chunk's usage said (None without
    continuous usage); carries is True when it brought content, reasoning or a tool call.
    """

    t: float
    tokens: int | None
    carries: bool
    content: bool = False

    def as_row(self) -> list[float | int | bool | None]:
        """The compact JSON form: [t, tokens, carries, content]."""
        return [round(self.t, 6), self.tokens, self.carries, self.content]


@dataclass
class RequestRecord:
    """One request: when it started (wall clock), its chunks, what it returned, how it ended."""

    started: float
    events: list[Event] = field(default_factory=list)
    status: int | None = None
    error: str | None = None
    ended: float | None = None  # seconds after start, when the stream closed
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    reasoning_tokens: int | None = None
    finish_reason: str | None = None
    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when the request completed without an error."""
        return self.error is None

    def as_json(self) -> dict[str, Any]:
        """The raw timings and outcome, for the run's JSON (texts left out: they can be big)."""
        data = asdict(self)
        data["events"] = [e.as_row() for e in self.events]
        data["content"] = self.content[:200]
        data["reasoning"] = self.reasoning[:200]
        return data


def record_from_json(data: dict[str, Any]) -> RequestRecord:
    """A request back from the run's JSON (its texts cut to 200 characters there)."""

    def whole(key: str) -> int | None:
        value = data.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    record = RequestRecord(started=float(data.get("started") or 0.0), status=whole("status"))
    record.events = [
        Event(float(t), tokens, bool(carries), bool(content))
        for t, tokens, carries, content in data.get("events") or []
    ]
    record.error = str(data["error"]) if data.get("error") is not None else None
    record.prompt_tokens, record.completion_tokens = (
        whole("prompt_tokens"),
        whole("completion_tokens"),
    )
    return record
