"""Start-up is a feature: listing the tasks or asking doit's help imports no network, crypto,
plotting or Kubernetes library. Counted, not timed: the modules loaded in a fresh process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# What a stage imports where its action runs, never when the graph is listed.
HEAVY = [
    "boto3",
    "botocore",
    "docker",
    "kubernetes",
    "securesystemslib",
    "in_toto_attestation",
    "model_signing",
    "cryptography",
    "matplotlib",
    "google.protobuf",
    "paramiko",
    "jinja2",
]
LOADED = """
import contextlib, io, json, sys
sys.argv = ["doit", *sys.argv[1:]]
from doit.__main__ import main
with contextlib.redirect_stdout(io.StringIO()):
    try:
        main()
    except SystemExit:
        pass
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in HEAVY_ROOTS)))
"""


def heavy_modules_after(*args: str) -> list[str]:
    """The heavy libraries' modules a fresh `doit ARGS` process has loaded when it is done."""
    roots = sorted({name.split(".")[0] for name in HEAVY})
    code = f"HEAVY_ROOTS = {roots!r}\n{LOADED}"
    run = subprocess.run(
        [sys.executable, "-c", code, *args], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    loaded = json.loads(run.stdout.splitlines()[-1])
    return sorted({m for m in loaded if any(m == h or m.startswith(h + ".") for h in HEAVY)})


@pytest.mark.parametrize(
    "args",
    [("list",), ("list", "profile=tp3-ring"), ("list", "profile=tp4-ring"), ("help", "deploy")],
)
def test_listing_the_tasks_loads_no_heavy_library(args):
    assert heavy_modules_after(*args) == []
