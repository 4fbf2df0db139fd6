"""The process's one pool of HTTP connections, and JSON calls on it.

The registry, the bench and deploy's health checks all talk to services over it. No retries
anywhere: an unreachable service is one clear error, not minutes of backoff, and a benchmark
request that failed counts as failed.
"""

from __future__ import annotations

import functools
import json
import time
from typing import Any

import urllib3

# What a call raises when the service does not answer (refused, reset, timed out).
HTTPError = urllib3.exceptions.HTTPError
# Up to this many kept-alive connections per host: a bench cell's concurrent streams.
CONNECTIONS = 64
# A JSON answer or a /metrics page the calls here read: some KiB; a server sending more is
# not answering honestly, and is never read past this.
MAX_ANSWER_BYTES = 16 << 20


class AnswerRefused(urllib3.exceptions.HTTPError):
    """An answer larger than its cap, or slower in all than its time: a failed call."""


@functools.cache
def http_pool() -> urllib3.PoolManager:
    """Kept-alive connections shared by every call of this process; a call may set its own
    timeout, else 30 s to connect and 300 s between bytes (a registry's large blobs)."""
    return urllib3.PoolManager(
        maxsize=CONNECTIONS,
        block=False,
        retries=False,
        timeout=urllib3.Timeout(connect=30, read=300),
    )


def fetch(
    method: str, url: str, timeout: float, cap: int = MAX_ANSWER_BYTES, **kwargs: Any
) -> tuple[int, bytes]:
    """One call, its answer read whole within timeout in all (not only between bytes: a server
    sending one byte at a time is stopped) and cap bytes: (status, body); AnswerRefused past
    either."""
    deadline = time.monotonic() + timeout
    r = http_pool().request(
        method, url, timeout=urllib3.Timeout(connect=timeout, read=timeout),
        preload_content=False, **kwargs,
    )  # fmt: skip
    whole = False
    try:
        data = bytearray()
        while chunk := r.read1(min(1 << 16, cap + 1 - len(data))):
            data += chunk
            if len(data) > cap:
                raise AnswerRefused(f"{url}: an answer over {cap >> 20} MiB")
            if time.monotonic() > deadline:
                raise AnswerRefused(f"{url}: no whole answer within {timeout:g} s")
        whole = True
        return r.status, bytes(data)
    finally:
        if not whole:  # the rest unread: the connection cannot serve another call
            r.close()
        r.release_conn()


def parsed(data: bytes) -> Any:
    """A JSON answer, or None (not JSON, or nested past the parser's depth)."""
    try:
        return json.loads(data)
    except (ValueError, RecursionError):
        return None


def get_json(url: str, timeout: float = 30) -> tuple[int, Any]:
    """GET a JSON document: (status, body or None)."""
    status, data = fetch("GET", url, timeout)
    return status, parsed(data)


def post_json(url: str, body: dict[str, Any], timeout: float = 60) -> tuple[int, Any]:
    """POST a JSON body and read a JSON answer: (status, body or None)."""
    status, data = fetch("POST", url, timeout, json=body)
    return status, parsed(data)
