"""Docker engines over ssh: the tunnel's connections are sessions on one ssh login, a refused
session still gets its answer, and a tunnel's process killed outright leaves no ssh behind.
Against a real OpenSSH server of the test's own (its log counts the logins) in front of the
tests' engine."""

from __future__ import annotations

import contextlib
import getpass
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
from support.ports import spare_ports

from devstack.engines import ssh_files, sshd_answers, sshd_command
from pipelines.targets.ssh import Tunnel

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def sshd(stack, tmp_path_factory):
    """(ssh:// URL of the tests' engine, its environment, the log of logins) through an sshd
    of this module's own."""
    folder = tmp_path_factory.mktemp("sshd")
    port = spare_ports()
    command = sshd_command(SimpleNamespace(directory=folder, ssh_port=port), {})
    log = folder / "sshd.log"
    with log.open("wb") as said:
        server = subprocess.Popen(command.argv, env=command.env, stderr=said)
    try:
        deadline = time.monotonic() + 15
        while not sshd_answers(f"127.0.0.1:{port}"):
            assert server.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        files = ssh_files(folder)
        environ = {
            **os.environ,
            "SPARKFORGE_SSH_IDENTITY": str(files["identity"]),
            "SPARKFORGE_SSH_KNOWN_HOSTS": str(files["known_hosts"]),
        }
        engine = stack.docker_host.removeprefix("unix://")
        yield f"ssh://{getpass.getuser()}@127.0.0.1:{port}{engine}", environ, log
    finally:
        server.terminate()
        server.wait(timeout=10)


def logins(log: Path) -> int:
    """How many times sshd let a client in."""
    return log.read_text(errors="replace").count("Accepted publickey")


def ping(tunnel: Tunnel) -> bytes:
    """The status line of the engine's answer to GET /_ping on a connection of its own."""
    with socket.socket(socket.AF_UNIX) as conn:
        conn.connect(tunnel.url.removeprefix("unix://"))
        conn.sendall(b"GET /_ping HTTP/1.1\r\nHost: docker\r\nConnection: close\r\n\r\n")
        answer = b""
        while chunk := conn.recv(4096):
            answer += chunk
    return answer.split(b"\r\n", 1)[0]


def test_every_connection_of_a_tunnel_is_a_session_on_one_login(sshd):
    url, environ, log = sshd
    before = logins(log)
    tunnel = Tunnel(url, environ)
    try:
        with ThreadPoolExecutor(3) as pool:
            together = list(pool.map(lambda _: ping(tunnel), range(3)))
        one_by_one = [ping(tunnel) for _ in range(3)]
    finally:
        tunnel.close()
    assert together + one_by_one == [b"HTTP/1.1 200 OK"] * 6
    assert logins(log) - before == 1  # the master's; the version check and six pings on it


def test_connections_past_the_servers_session_limit_still_get_their_answers(sshd):
    url, environ, log = sshd
    tunnel = Tunnel(url, environ)
    try:
        # sshd's MaxSessions is 10: the master's own session and 13 more at once.
        with ThreadPoolExecutor(13) as pool:
            answers = list(pool.map(lambda _: ping(tunnel), range(13)))
    finally:
        tunnel.close()
    assert answers == [b"HTTP/1.1 200 OK"] * 13


def ssh_processes_naming(path: str) -> list[str]:
    """The command lines of the ssh processes whose command line names path (a master in the
    background rewrites its own: `ssh: PATH [mux]`)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            name = (proc / "comm").read_text().strip()
            argv = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if name == "ssh" and path.encode() in argv:
            found.append(argv.replace(b"\0", b" ").decode(errors="replace"))
    return found


def test_a_tunnels_process_killed_outright_leaves_no_ssh_behind(sshd, tmp_path):
    url, environ, _ = sshd
    holder = (
        "import sys, time\n"
        "from pipelines.targets.ssh import Tunnel\n"
        "tunnel = Tunnel(sys.argv[1])\n"
        "print(tunnel.folder.name, flush=True)\n"
        "time.sleep(600)\n"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", holder, url],
        cwd=REPO,
        env=environ,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its ssh are not in the test's process group, nor ended with it
    )
    folder = ""
    try:
        assert process.stdout is not None
        folder = process.stdout.readline().strip()
        assert folder, "the tunnel did not open"
        assert ssh_processes_naming(folder), "no master connection"
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=10)
        deadline = time.monotonic() + 15
        while (left := ssh_processes_naming(folder)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not left, f"ssh left behind: {left}"
    finally:
        # What a failed test left: the holder and its ssh, one process group; and the tunnel's
        # folder, which a process killed outright cannot remove.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)
        if folder.startswith(tempfile.gettempdir()) and "sparkforge-ssh-" in folder:
            shutil.rmtree(folder, ignore_errors=True)
