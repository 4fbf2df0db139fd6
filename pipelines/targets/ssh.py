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
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO
from urllib.parse import urlsplit

from pipelines.core.errors import DeployError

DEFAULT_SOCKET = "/var/run/docker.sock"
CONNECT_TIMEOUT_S = 15
# A unix socket's path holds 108 bytes; ssh binds the master's at the path plus 17 (a random
# suffix it renames away).
CONTROL_PATH_MAX = 108 - 1 - 17


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

    def ssh(
        self, environ: Mapping[str, str], *remote: str, control: Path | None = None
    ) -> list[str]:
        """The ssh command running `docker -H unix://<socket> <remote...>` on the host; with
        control, a session on the master connection listening there, or the master itself
        where none listens yet (ssh's ControlMaster=auto)."""
        argv = ["ssh", "-T", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes"]
        argv += ["-o", f"ConnectTimeout={CONNECT_TIMEOUT_S}"]
        if control is not None:
            # No ControlPersist: a master stays one of the tunnel's processes, never forked to
            # the background; it serves the sessions it carries until they end, then exits.
            argv += ["-o", "ControlMaster=auto", "-o", f"ControlPath={control}"]
            argv += ["-o", "ControlPersist=no"]
        if environ.get("SPARKFORGE_SSH_IDENTITY"):
            argv += ["-i", environ["SPARKFORGE_SSH_IDENTITY"], "-o", "IdentitiesOnly=yes"]
        if environ.get("SPARKFORGE_SSH_KNOWN_HOSTS"):
            argv += ["-o", f"UserKnownHostsFile={environ['SPARKFORGE_SSH_KNOWN_HOSTS']}"]
        if self.port:
            argv += ["-p", str(self.port)]
        login = f"{self.user}@{self.host}" if self.user else self.host
        command = ["docker", "-H", f"unix://{self.socket}", *remote]
        return argv + ["--", login, shlex.join(command)]


def last_line(said: str, code: int) -> str:
    """What ssh said last on its stderr, or its exit status where it said nothing."""
    lines = said.strip().splitlines()
    return lines[-1] if lines else f"ssh exited {code}"


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
    """A local socket whose every connection is `docker system dial-stdio` on the host, each a
    session on one ssh connection the tunnel holds open (its master)."""

    def __init__(self, url: str, environ: Mapping[str, str] = os.environ):
        self.engine = SshEngine.parse(url)
        self.environ = dict(environ)
        self.folder = tempfile.TemporaryDirectory(prefix="sparkforge-ssh-")
        # Each connection of the SDK (a stream, a wait, a pool's second request) would cost an
        # ssh handshake and login: some 70 ms of CPU and 0.2 s here, more over a real network.
        # Sessions on the master cost neither. Where sshd refuses another session (MaxSessions,
        # 10 by default) ssh connects on its own; where the path is too long for a socket,
        # every connection does.
        mux = Path(self.folder.name) / "m"
        self.control = mux if len(str(mux)) <= CONTROL_PATH_MAX else None
        self.master: subprocess.Popen[bytes] | None = None
        try:
            if self.control is not None:
                self.master = self._open_master(url, self.control)
            check = subprocess.run(
                self.engine.ssh(
                    self.environ, "version", "--format", "{{.Server.Version}}", control=self.control
                ),
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=CONNECT_TIMEOUT_S + 30,
            )
            if check.returncode != 0:
                raise DeployError(f"{url}: ssh: {last_line(check.stderr, check.returncode)}")
        except BaseException:
            self._end_master()
            self.folder.cleanup()
            raise
        path = Path(self.folder.name) / "docker.sock"
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(str(path))
        self.server.listen(16)
        self.processes: list[subprocess.Popen[bytes]] = []
        threading.Thread(target=self._serve, daemon=True).start()
        self.url = f"unix://{path}"

    def _open_master(self, url: str, control: Path) -> subprocess.Popen[bytes]:
        """The master connection, once its socket listens; DeployError if ssh gave up first.

        Its own session is a dial-stdio that reads the tunnel's pipe: if this process dies,
        however killed, the pipe closes, that session ends, and the master exits with the last
        session it carries (no ControlPersist, nothing left in the background)."""
        log = Path(self.folder.name) / "master.log"
        with log.open("wb") as said:
            master = subprocess.Popen(
                self.engine.ssh(self.environ, "system", "dial-stdio", control=control),
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=said,
            )
        deadline = time.monotonic() + CONNECT_TIMEOUT_S + 30
        while not control.is_socket():
            code = master.poll()
            if code is not None:
                raise DeployError(f"{url}: ssh: {last_line(log.read_text(errors='replace'), code)}")
            if time.monotonic() > deadline:
                master.kill()
                master.wait()
                raise DeployError(f"{url}: ssh: no connection in {CONNECT_TIMEOUT_S + 30} s")
            time.sleep(0.01)
        return master

    def _end_master(self) -> None:
        """End the master connection, and with it any session still on it."""
        if self.master is None:
            return
        with contextlib.suppress(OSError):
            if self.master.stdin is not None:
                self.master.stdin.close()
        if self.master.poll() is None:
            self.master.terminate()
        self.master.wait(timeout=10)

    def _serve(self) -> None:
        """Accept connections until closed; each gets its own ssh."""
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            process = subprocess.Popen(
                self.engine.ssh(self.environ, "system", "dial-stdio", control=self.control),
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
        self._end_master()
        self.folder.cleanup()
