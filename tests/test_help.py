"""`doit help TASK` names the name=value arguments the task reads, and what each means."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pipelines.engine.variables import VARIABLES, reading

REPO = Path(__file__).resolve().parent.parent
DOIT = Path(sys.executable).parent / "doit"


def doit_help(*args: str) -> str:
    """What `doit help ...` prints here (listing the tasks needs nothing running)."""
    run = subprocess.run(
        [str(DOIT), "help", *args], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stderr
    return run.stdout


def read_by(task: str, *args: str) -> list[str]:
    """The variables `doit help TASK` lists, as written (profile=NAME, prune=no, ...)."""
    out = doit_help(task, *args)
    listed = out.split("reads (after the task name, as doit TASK name=value):\n", 1)[1]
    return [line.split()[0] for line in listed.splitlines() if line.strip()]


@pytest.mark.parametrize(
    ("task", "args", "names"),
    [
        ("deploy", (), ["profile", "image_digest", "stager_digest", "prune"]),
        ("diff", (), ["profile", "image_digest", "stager_digest", "prune"]),
        ("rollback", (), ["profile", "prune"]),
        ("render", (), ["profile", "image_digest", "stager_digest"]),
        ("build", (), ["profile", "image_digest", "stager_digest", "platform"]),
        ("image", (), ["profile", "platform"]),
        ("fabric", ("profile=tp4-ring",), ["profile", "expect", "prune", "image_digest"]),
        ("stager_plan", ("profile=local-ring",), ["profile", "platform"]),
        ("fetch_weights", (), ["profile"]),
    ],
)
def test_help_names_each_variable_the_task_reads(task, args, names):
    assert read_by(task, *args) == [VARIABLES[name][0] for name in names]


def test_help_says_what_a_variable_does():
    out = doit_help("deploy")
    assert "prune=no" in out and "keep what a new render dropped" in out
    assert out.startswith("deploy  deploy the built profile")


def test_a_task_cannot_name_a_variable_no_one_reads():
    with pytest.raises(ValueError, match="unknown doit variables \\['prunee'\\]"):
        reading(["prunee"])
