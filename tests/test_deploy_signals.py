"""SIGTERM and SIGHUP stop a deploy as Ctrl-C does, are held off while it restores, and stay
ignored where the process was started ignoring them (each case in a child process of its own)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def run(body: str, ignored: tuple[signal.Signals, ...] = ()) -> subprocess.CompletedProcess:
    """body in a fresh interpreter, SIGTERM and SIGHUP at their defaults unless ignored."""

    def dispositions() -> None:
        for s in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(s, signal.SIG_IGN if s in ignored else signal.SIG_DFL)

    script = "import os, signal, time\n"
    script += "from pipelines.stages.deploy.signals import "
    script += "Terminated, restoring, terminate_as_interrupt\n"
    return subprocess.run(
        [sys.executable, "-c", script + textwrap.dedent(body)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=dispositions,
    )


@pytest.mark.parametrize("name", ["SIGTERM", "SIGHUP"])
def test_a_stop_signal_raises_terminated_and_is_held_off_while_restoring(name):
    result = run(f"""
        try:
            with terminate_as_interrupt():
                os.kill(os.getpid(), signal.{name})
                time.sleep(5)
            print("not raised")
        except Terminated as err:
            with restoring():
                os.kill(os.getpid(), signal.{name})  # the runner's next signal
                time.sleep(0.2)
                print("restored after", err)
        assert signal.getsignal(signal.{name}) is signal.SIG_DFL  # as it was before
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"restored after {name}\n"


def test_a_signal_the_process_was_started_ignoring_stays_ignored():
    result = run(
        """
        with terminate_as_interrupt():
            os.kill(os.getpid(), signal.SIGHUP)  # a nohup'd deploy outlives its terminal
            time.sleep(0.2)
        print("still deploying")
        """,
        ignored=(signal.SIGHUP,),
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "still deploying\n"
