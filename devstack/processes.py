"""The services' processes: launch detached, find by pid file, signal, wait, stop, clean up."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from devstack.files import log_file, pid_file
from devstack.settings import StackError

STOP_TIMEOUT = 30.0
KILL_TIMEOUT = 5.0
POLL_SECONDS = 0.1

# Services this process launched, so their exit is reaped (no zombies) and seen at once.
_CHILDREN: dict[int, subprocess.Popen[bytes]] = {}


@dataclass(frozen=True)
class Command:
    """How to launch one service: its argv, its environment and the ports it will bind."""

    argv: list[str]
    env: dict[str, str]
    ports: tuple[int, ...]


def alive(pid: int) -> bool:
    """Whether pid is a live process (a zombie counts as gone)."""
    child = _CHILDREN.get(pid)
    if child is not None:
        return child.poll() is None
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def cmdline(pid: int) -> list[str]:
    """The argv of pid, empty when it is gone."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return []
    return raw.decode(errors="replace").split("\0")


def running_pid(directory: Path, name: str, marker: str) -> int | None:
    """The pid of this stack's `name` service when it is alive and shows marker, else None."""
    try:
        pid = int(pid_file(directory, name).read_text().strip())
    except (FileNotFoundError, ValueError):
        return None
    if not alive(pid):
        return None
    # A child of ours is known by its Popen (its cmdline can still be empty just after
    # Popen returns, mid-exec); any other pid must show our marker, in case it was reused.
    if pid not in _CHILDREN and not shows_marker(cmdline(pid), marker):
        return None
    return pid


def shows_marker(argv: list[str], marker: str) -> bool:
    """Whether argv holds marker as an argument, also once a process retitled itself into one
    string (sshd: "sshd: /usr/sbin/sshd -D -f <config> [listener] ...")."""
    return marker in argv or f" {marker} " in f" {' '.join(argv)} "


def exit_code(directory: Path, name: str) -> int | None:
    """The exit code of `name` when this process launched it and it has exited."""
    with contextlib.suppress(FileNotFoundError, ValueError):
        child = _CHILDREN.get(int(pid_file(directory, name).read_text()))
        return child.poll() if child is not None else None
    return None


def launch(directory: Path, name: str, command: Command) -> int:
    """Start one service detached, logging to <name>.log, and record its pid."""
    with log_file(directory, name).open("ab") as log:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        # The argv carries no secret: credentials travel in the environment only.
        log.write(f"--- {stamp} sparkforge stack starts: {' '.join(command.argv)}\n".encode())
        log.flush()
        try:
            child = subprocess.Popen(
                command.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=command.env,
                cwd=directory,
                # Own session: the service outlives the CLI and a Ctrl-C in its terminal.
                # close_fds (the default) keeps the stack lock out of the service.
                start_new_session=True,
            )
        except OSError as error:
            raise StackError(f"{name}: cannot run {command.argv[0]}: {error.strerror}") from None
    _CHILDREN[child.pid] = child
    pid_file(directory, name).write_text(f"{child.pid}\n")
    return child.pid


def forget(pid: int | None) -> None:
    """Stop tracking a launched service that has been stopped."""
    if pid is not None:
        _CHILDREN.pop(pid, None)


def send(pid: int, signum: int, group: bool = False) -> None:
    """Send signum to pid (or its whole process group), ignoring one that is already gone."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if group:
            os.killpg(pid, signum)
        else:
            os.kill(pid, signum)


def wait_gone(pids: Mapping[str, int], timeout: float) -> dict[str, int]:
    """Wait until every pid has exited or timeout passes; return those still alive."""
    deadline = time.monotonic() + timeout
    left = dict(pids)
    while left and time.monotonic() < deadline:
        left = {name: pid for name, pid in left.items() if alive(pid)}
        if left:
            time.sleep(POLL_SECONDS)
    return {name: pid for name, pid in left.items() if alive(pid)}


def terminate(running: Mapping[str, int]) -> None:
    """SIGTERM these services, SIGKILL what outlives STOP_TIMEOUT; fail if any still lives."""
    for pid in running.values():
        send(pid, signal.SIGTERM)
    stubborn = wait_gone(running, STOP_TIMEOUT)
    for pid in stubborn.values():
        # The whole process group, so helpers that share the service's session go too.
        send(pid, signal.SIGKILL, group=True)
    stuck = wait_gone(stubborn, KILL_TIMEOUT)
    if stuck:
        listed = ", ".join(f"{name} (pid {pid})" for name, pid in stuck.items())
        raise StackError(f"{listed} did not exit after SIGKILL")


def kill_leftovers(exec_root: Path) -> None:
    """SIGKILL containerd, shims and containers still tied to exec_root (a killed dockerd)."""
    # dockerd starts containerd and the shims in sessions of their own, so a process-group
    # kill misses them; after a graceful stop dockerd has ended them and this finds nothing.
    marker = f"{exec_root}/"
    parents = _parent_pids()
    leftovers = {pid for pid in parents if any(marker in arg for arg in cmdline(pid))}
    # A shim's children are the containers' processes, which do not name exec_root.
    while grown := {pid for pid, ppid in parents.items() if ppid in leftovers} - leftovers:
        leftovers |= grown
    leftovers.discard(os.getpid())
    for pid in leftovers:
        send(pid, signal.SIGKILL)
    stuck = wait_gone({str(pid): pid for pid in leftovers}, KILL_TIMEOUT)
    if stuck:
        raise StackError(f"docker: pids {', '.join(stuck)} of {exec_root} survived SIGKILL")


def _parent_pids() -> dict[int, int]:
    """pid -> parent pid for every process."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                fields = (entry / "stat").read_text().rpartition(")")[2].split()
                parents[int(entry.name)] = int(fields[1])
    return parents


def unmount_below(root: Path) -> None:
    """Unmount what dockerd left mounted below root (netns, data root), so it can be removed."""
    prefix = f"{root}/"
    mounts = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        # Field 5 is the mount point, with space, tab, newline and backslash octal-escaped.
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), line.split()[4])
        if point.startswith(prefix):
            mounts.append(point)
    for point in sorted(mounts, key=len, reverse=True):
        result = subprocess.run(["umount", point], capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise StackError(f"docker: cannot unmount {point}: {result.stderr.strip()}")
