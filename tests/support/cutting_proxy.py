"""A TCP proxy to a real service on loopback that cuts connections, as a flaky network does."""

from __future__ import annotations

import contextlib
import socket
import threading


class CuttingProxy:
    """Proxies to 127.0.0.1:target_port; every `every`-th connection is cut once `limit` bytes
    of its reply (or, with `request`, of its request) have passed, at most `times` cuts."""

    def __init__(
        self,
        target_port: int,
        every: int = 3,
        limit: int = 300_000,
        request: bool = False,
        times: int | None = None,
    ):
        self.target = ("127.0.0.1", target_port)
        self.every, self.limit, self.request, self.times = every, limit, request, times
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.connections = 0
        self.cuts = 0
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            self.connections += 1
            cut = self.connections % self.every == 0 and (
                self.times is None or self.cuts < self.times
            )
            upstream = socket.create_connection(self.target)
            limit = self.limit if cut else None
            up, down = (limit, None) if self.request else (None, limit)
            threading.Thread(target=self.pipe, args=(client, upstream, up), daemon=True).start()
            threading.Thread(target=self.pipe, args=(upstream, client, down), daemon=True).start()

    def pipe(self, src: socket.socket, dst: socket.socket, limit: int | None) -> None:
        sent = 0
        try:
            while data := src.recv(65536):
                if limit is not None and sent + len(data) > limit:
                    self.cuts += 1
                    break
                dst.sendall(data)
                sent += len(data)
        except OSError:
            pass
        for sock in (src, dst):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def close(self) -> None:
        self.server.close()
