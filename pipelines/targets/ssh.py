"""Docker engines over ssh: `ssh://user@host[:port][/engine socket]`, as the docker CLI does it.

Each connection of the Docker SDK to a local socket runs `docker system dial-stdio` on the host
over ssh (the engine's socket given by -H; default /var/run/docker.sock), its stdin and stdout
being the connection. No forwarding is asked of sshd (OpenSSH never forwards unix sockets for
root). The key and known_hosts come from the environment, as ssh's own settings would
(SPARKFORGE_SSH_IDENTITY, SPARKFORGE_SSH_KNOWN_HOSTS; else ~/.ssh/config and the agent); the
host key is always checked.
"""

from __future__ import annotations

import contextlib
import io
import os
import shlex
import socket
import subprocess
import tempfile
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO
from urllib.parse import urlsplit

from pipelines.core.errors import DeployError

DEFAULT_SOCKET = "/var/run/docker.sock"
CONNECT_TIMEOUT_S = 15


@dataclass(frozen=True)
class SshEngine:
    """Where an ssh:// Docker URL points: the login and the engine's socket on that host."""

    user: str | None
    host: str
    port: int | None
    socket: str

    @classmethod
    def parse(cls, url: str) -> SshEngine:
        """The parts of an ssh:// URL, or DeployError naming what is wrong."""
        parts = urlsplit(url)
        if parts.scheme != "ssh" or not parts.hostname:
            raise DeployError(f"{url}: expected ssh://[user@]host[:port][/engine socket]")
        return cls(parts.username, parts.hostname, parts.port, parts.path or DEFAULT_SOCKET)

    def ssh(self, environ: Mapping[str, str], *remote: str) -> list[str]:
        """The ssh command running `docker -H unix://<socket> <remote...>` on the host."""
        argv = ["ssh", "-T", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes"]
        argv += ["-o", f"ConnectTimeout={CONNECT_TIMEOUT_S}"]
        if environ.get("SPARKFORGE_SSH_IDENTITY"):
            argv += ["-i", environ["SPARKFORGE_SSH_IDENTITY"], "-o", "IdentitiesOnly=yes"]
        if environ.get("SPARKFORGE_SSH_KNOWN_HOSTS"):
            argv += ["-o", f"UserKnownHostsFile={environ['SPARKFORGE_SSH_KNOWN_HOSTS']}"]
        if self.port:
            argv += ["-p", str(self.port)]
        login = f"{self.user}@{self.host}" if self.user else self.host
        command = ["docker", "-H", f"unix://{self.socket}", *remote]
        return argv + ["--", login, shlex.join(command)]


def _socket_to_pipe(conn: socket.socket, pipe: IO[bytes]) -> None:
    """The SDK's bytes to ssh's stdin, until the SDK stops writing."""
    with contextlib.suppress(OSError, ValueError):
        while chunk := conn.recv(65536):
            pipe.write(chunk)
            pipe.flush()
    with contextlib.suppress(OSError, ValueError):
        pipe.close()


def _pipe_to_socket(pipe: io.BufferedReader, conn: socket.socket) -> None:
    """ssh's stdout (the engine's answers) to the SDK, until the engine is done."""
    with contextlib.suppress(OSError, ValueError):
        while chunk := pipe.read1(65536):
            conn.sendall(chunk)
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_WR)


class Tunnel:
    """A local socket whose every connection is `docker system dial-stdio` on the host."""

    def __init__(self, url: str, environ: Mapping[str, str] = os.environ):
        self.engine = SshEngine.parse(url)
        self.environ = dict(environ)
        check = subprocess.run(
            self.engine.ssh(self.environ, "version", "--format", "{{.Server.Version}}"),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=CONNECT_TIMEOUT_S + 30,
        )
        if check.returncode != 0:
            said = check.stderr.strip().splitlines()
            reason = said[-1] if said else f"ssh exited {check.returncode}"
            raise DeployError(f"{url}: ssh: {reason}")
        self.folder = tempfile.TemporaryDirectory(prefix="sparkforge-ssh-")
        path = Path(self.folder.name) / "docker.sock"
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(str(path))
        self.server.listen(16)
        self.processes: list[subprocess.Popen[bytes]] = []
        threading.Thread(target=self._serve, daemon=True).start()
        self.url = f"unix://{path}"

    def _serve(self) -> None:
        """Accept connections until closed; each gets its own ssh."""
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            process = subprocess.Popen(
                self.engine.ssh(self.environ, "system", "dial-stdio"),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
            )
            self.processes.append(process)
            threading.Thread(
                target=_socket_to_pipe, args=(conn, process.stdin), daemon=True
            ).start()
            threading.Thread(
                target=_pipe_to_socket, args=(process.stdout, conn), daemon=True
            ).start()

    def close(self) -> None:
        """Stop accepting, end the ssh processes, remove the socket."""
        self.server.close()
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
                process.wait(timeout=10)
        self.folder.cleanup()
