"""HTTP servers a test runs in a thread on loopback: shut down within a poll of 20 ms (the
standard library's loop polls every 0.5 s, and shutdown() waits for its turn), and a client
that hangs up mid-answer (what many tests make clients do) is not printed as a traceback."""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

POLL_S = 0.02


class QuietHTTPServer(ThreadingHTTPServer):
    """A ThreadingHTTPServer that drops a client's hang-up silently; other errors as before."""

    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], ConnectionError):
            return
        super().handle_error(request, client_address)


def start(server: ThreadingHTTPServer) -> threading.Thread:
    """server's loop in a daemon thread, polling for shutdown every POLL_S."""
    thread = threading.Thread(target=server.serve_forever, args=(POLL_S,), daemon=True)
    thread.start()
    return thread


@contextlib.contextmanager
def serving(
    handler: Callable[..., BaseHTTPRequestHandler], host: str = "127.0.0.1"
) -> Iterator[str]:
    """A QuietHTTPServer of handler on a free port of host, its URL, until the block ends."""
    server = QuietHTTPServer((host, 0), handler)
    start(server)
    try:
        yield f"http://{host}:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
