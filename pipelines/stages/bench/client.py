"""One streamed chat completion against an OpenAI-compatible server, timed chunk by chunk."""

from __future__ import annotations

import json
import time
from typing import Any

import urllib3

from pipelines.core.httpjson import http_pool
from pipelines.stages.bench.record import Event, RequestRecord
from pipelines.stages.bench.sse import DONE, BadStream, Chunk, EventBuffer, read_chunk

STREAM_OPTIONS = {"include_usage": True, "continuous_usage_stats": True}
# A prompt's token count a server may claim: more than any context served today.
MAX_PROMPT_TOKENS = 10_000_000


class BadCount(Exception):
    """A token count the server sent that cannot be true: the request fails with it."""


JSON_HEADERS = {"Content-Type": "application/json"}


def stream_chat(base_url: str, body: dict[str, Any], timeout: float) -> RequestRecord:
    """POST a streaming chat completion and record every chunk's arrival; never raises: the
    request is ok or failed with its reason, whatever the server sends."""
    record = RequestRecord(started=time.time())
    try:
        return exchange(base_url, body, timeout, record)
    except Exception as err:  # noqa: BLE001 - a request must never vanish from its cell
        record.error = f"client failed: {type(err).__name__}: {str(err)[:200]}"
        return record


def exchange(
    base_url: str, body: dict[str, Any], timeout: float, record: RequestRecord
) -> RequestRecord:
    """The request itself, recorded into record (stream_chat's)."""
    # Encoded before the clock starts: with C streams sharing one interpreter, every
    # microsecond between the start and the bytes leaving is added to TTFT.
    data = json.dumps({**body, "stream": True, "stream_options": STREAM_OPTIONS}).encode()
    url, pool = f"{base_url}/v1/chat/completions", http_pool()
    # Both clocks read at one instant: a chunk's wall-clock time is started + its offset.
    record.started, origin = time.time(), time.perf_counter()
    try:
        response = pool.request(
            "POST",
            url,
            body=data,
            headers=JSON_HEADERS,
            preload_content=False,
            timeout=urllib3.Timeout(connect=min(timeout, 30), read=timeout),
        )
    except urllib3.exceptions.HTTPError as err:
        record.error = f"unreachable: {type(err).__name__}: {reason_of(err)}"
        return record
    record.status = response.status
    clean = False
    try:
        if response.status != 200:
            record.error = f"HTTP {response.status}: {error_message(response.read(65536))}"
            clean = True
        else:
            clean = read_stream(response, record, origin, timeout, body.get("max_tokens"))
    except urllib3.exceptions.TimeoutError:
        record.error = f"timeout: no chunk for {timeout:.0f} s"
    except urllib3.exceptions.HTTPError as err:
        record.error = f"stream broken: {type(err).__name__}: {reason_of(err)}"
    finally:
        record.ended = time.perf_counter() - origin
        finish_response(response, clean)
    return record


def finish_response(response: urllib3.BaseHTTPResponse, clean: bool) -> None:
    """Give the connection back only when its body was read to the end, else close it.

    After [DONE] the chunked body still has its last, empty chunk on the wire: a connection
    handed back before reading it starts the next request's answer with "0\r\n".
    """
    if clean:
        try:
            response.drain_conn()
        except urllib3.exceptions.HTTPError:
            response.close()
    else:
        response.close()
    response.release_conn()


def read_stream(
    response: urllib3.BaseHTTPResponse,
    record: RequestRecord,
    origin: float,
    deadline: float,
    max_tokens: int | None = None,
) -> bool:
    """Read SSE events into record until [DONE]; a cut, an error body, a malformed event, a
    count that cannot be true or the deadline fails it.

    True when the stream ended as it should ([DONE]), so the connection can be kept.
    """
    events = EventBuffer()
    done = False
    while not done:
        data = response.read1(65536)
        now = time.perf_counter() - origin
        if not data:
            break
        try:
            payloads = events.feed(data)
        except BadStream as err:
            record.error = f"malformed stream: {err}"
            return False
        for payload in payloads:
            if payload.strip() == DONE:
                done = True
                break
            chunk = read_chunk(payload)
            if chunk.error:
                record.error = f"error in stream: {chunk.error}"
                return False
            try:
                take_chunk(record, chunk, now, max_tokens)
            except BadCount as err:
                record.error = f"bad usage: {err}"
                return False
        if now > deadline and not done:
            record.error = f"timeout: no [DONE] within {deadline:.0f} s"
            return False
    if not done:
        record.error = "stream ended before [DONE]" + (" (mid-event)" if events.leftover else "")
    return done


def count(usage: dict[str, Any], name: str, low: int, high: int) -> int | None:
    """A token count of usage (None when absent); BadCount when it is not a whole number
    from low to high."""
    value = usage.get(name)
    if value is None:
        return None
    if type(value) is not int or not low <= value <= high:
        shown = json.dumps(value)[:40]
        raise BadCount(f"{name} {shown}: expected a whole number from {low} to {high}")
    return value


def take_chunk(
    record: RequestRecord, chunk: Chunk, now: float, max_tokens: int | None = None
) -> None:
    """Add one chunk's arrival and content to the record; BadCount for a count that cannot be
    true (above what was asked, falling, negative, not a whole number)."""
    usage = chunk.usage or {}
    so_far = record.completion_tokens or 0
    tokens = count(usage, "completion_tokens", so_far, max_tokens or MAX_PROMPT_TOKENS)
    prompt = count(usage, "prompt_tokens", 0, MAX_PROMPT_TOKENS)
    details = usage.get("completion_tokens_details") or {}
    reasoning = (
        count(details, "reasoning_tokens", 0, tokens or so_far)
        if isinstance(details, dict)
        else None
    )
    record.events.append(Event(now, tokens, chunk.carries_token, bool(chunk.content)))
    record.content += chunk.content
    record.reasoning += chunk.reasoning
    record.tool_calls += chunk.tool_calls
    record.finish_reason = chunk.finish_reason or record.finish_reason
    if usage:
        record.prompt_tokens = prompt if prompt is not None else record.prompt_tokens
        record.completion_tokens = tokens if tokens is not None else record.completion_tokens
        if reasoning is not None:
            record.reasoning_tokens = reasoning


def reason_of(err: Exception) -> str:
    """The innermost reason of a urllib3 error, in a few words."""
    reason = getattr(err, "reason", None) or err
    return str(reason)[:200]


def error_message(body: bytes) -> str:
    """What an error answer says: its JSON `error.message` (OpenAI, vLLM), `detail` or
    `message`, else the start of the body as text; on one line."""
    try:
        data = json.loads(body)
    except ValueError:
        data = None
    said: Any = None
    if isinstance(data, dict):
        said = data.get("error") or data.get("detail") or data.get("message")
        if isinstance(said, dict):
            said = said.get("message") or said.get("detail")
    text = str(said) if said else body[:300].decode(errors="replace")
    return " ".join(text.split())[:300]
