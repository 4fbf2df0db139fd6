"""One deploy, rollback or ring staging of a profile at a time per store: a second one waits for
the first, saying on one line whose turn it is. An flock, so the kernel lets go when its holder
dies: a killed deploy never blocks the next one."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from pipelines.core.errors import INTERRUPTED, DeployError
from pipelines.core.progress import say
from pipelines.stages.deploy.signals import Terminated


class StoppedWaiting(DeployError):
    """Ctrl-C, SIGTERM or SIGHUP while waiting for another deploy's turn: nothing touched."""

    exit_code = INTERRUPTED


def profile_lock(deployments: Path, profile: str) -> Path:
    """Beside the profile's records (`<store>/deployments/<profile>/`): its deploy lock."""
    return deployments / f"{profile}.lock"


@contextlib.contextmanager
def in_turn(path: Path, profile: str, action: str, who: str) -> Iterator[None]:
    """Hold the profile's deploy lock for the block; while another process holds it, wait,
    after one line naming it (Ctrl-C, SIGTERM or SIGHUP stop the wait: StoppedWaiting, 130)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            held = holder(path, profile)
            say(action, f"waiting for the {held} ...")
            try:
                fcntl.flock(f, fcntl.LOCK_EX)
            except (KeyboardInterrupt, Terminated) as stop:
                signal = str(stop) or "SIGINT"  # Terminated names its signal; Ctrl-C is SIGINT
                raise StoppedWaiting(
                    f"{action} of profile {profile}: stopped ({signal}) while waiting for the"
                    f" {held}; nothing touched"
                ) from None
        try:
            say_holder(f, action, who)
            yield
        finally:
            f.truncate(0)  # the holder line names only a live holder
            fcntl.flock(f, fcntl.LOCK_UN)


def say_holder(f: IO[str], action: str, who: str) -> None:
    """Write who holds the lock into it, for the line a waiter prints."""
    f.truncate(0)
    f.write(json.dumps({"pid": os.getpid(), "action": action, "who": who, "since": time.time()}))
    f.flush()


def holder(path: Path, profile: str) -> str:
    """'deploy of profile P held by pid N (who, since HH:MM:SS UTC)', from what the holder
    wrote; less when that is not there yet or not what a holder writes."""
    try:
        with open(path) as f:
            held = json.loads(f.read(4096))  # a holder writes ~150 bytes; more is not one
        action, pid, who = str(held["action"]), int(held["pid"]), str(held["who"])
        since = time.strftime("%H:%M:%S UTC", time.gmtime(float(held["since"])))
    except (OSError, ValueError, KeyError, TypeError, OverflowError, RecursionError):
        return f"deploy of profile {profile} held by another process"
    if not (action.isidentifier() and who.isprintable() and len(who) <= 200):
        return f"deploy of profile {profile} held by pid {pid}"
    return f"{action} of profile {profile} held by pid {pid} ({who}, since {since})"
