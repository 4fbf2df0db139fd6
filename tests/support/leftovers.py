"""What a test that timed out started ends with it: after a call pytest-timeout stopped, every
process the call started that still runs is killed with its whole process group, so nothing it
began (a deploy still waiting, a build) changes a later test. Only then: a call that ends by
itself may start what later tests share on purpose (an engine of the stack started on first
use, an ssh tunnel a client keeps), and fixtures stop what they start."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest


def children_by_parent() -> dict[int, list[int]]:
    """Every live process's children, from /proc (zombies left out: they hold nothing)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # gone meanwhile
        # pid (comm) state ppid ...: comm may hold spaces and parentheses; the rest follows
        # its last ')'.
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if state != "Z":
            children.setdefault(int(ppid), []).append(int(entry.name))
    return children


def descendants(pid: int) -> set[int]:
    """The processes below pid, however deep."""
    children, found, todo = children_by_parent(), set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def kill_started_since(before: set[int]) -> list[int]:
    """SIGKILL each process below this one that was not there before, with its process group
    when that is its own; the pids killed."""
    ours = os.getpgid(0)
    new = sorted(descendants(os.getpid()) - before)
    for pid in new:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            group = os.getpgid(pid)
            if group != ours:
                os.killpg(group, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)
    return new


def timed_out(excinfo: tuple[type, BaseException, object] | None) -> bool:
    """Whether a call ended by pytest-timeout's failure (its message starts 'Timeout')."""
    return (
        excinfo is not None
        and isinstance(excinfo[1], pytest.fail.Exception)
        and str(excinfo[1]).startswith("Timeout")
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    """Run the test's call; when it timed out, end whatever it started and left running."""
    before = descendants(os.getpid())
    outcome = yield
    if timed_out(outcome.excinfo):  # type: ignore[attr-defined]
        kill_started_since(before)
