"""The process's one pool of HTTP connections, and JSON calls on it.

The registry, the bench and deploy's health checks all talk to services over it. No retries
anywhere: an unreachable service is one clear error, not minutes of backoff, and a benchmark
request that failed counts as failed.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import urllib3

# What a call raises when the service does not answer (refused, reset, timed out).
HTTPError = urllib3.exceptions.HTTPError
# Up to this many kept-alive connections per host: a bench cell's concurrent streams.
CONNECTIONS = 64


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


def get_json(url: str, timeout: float = 30) -> tuple[int, Any]:
    """GET a JSON document: (status, body or None)."""
    r = http_pool().request("GET", url, timeout=timeout, preload_content=True)
    try:
        return r.status, json.loads(r.data)
    except ValueError:
        return r.status, None


def post_json(url: str, body: dict[str, Any], timeout: float = 60) -> tuple[int, Any]:
    """POST a JSON body and read a JSON answer: (status, body or None)."""
    r = http_pool().request("POST", url, json=body, timeout=timeout, preload_content=True)
    try:
        return r.status, json.loads(r.data)
    except ValueError:
        return r.status, None
