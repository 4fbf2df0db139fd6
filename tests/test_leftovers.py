"""A test that times out leaves nothing running: what its call started is killed with its
process group before the next test (support/leftovers.py); a test that ends by itself keeps
what it started on purpose."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

STARTS_AND_HANGS = """
import subprocess, sys, time
import pytest

@pytest.mark.timeout(2)
def test_hangs(tmp_path_factory):
    # A child in a group of its own, and its own child: the whole group must go.
    group = subprocess.Popen(
        ["sh", "-c", "sleep 300 & echo $! > {pids}/grandchild; exec sleep 300"],
        start_new_session=True,
    )
    same = subprocess.Popen(["sleep", "300"])
    with open("{pids}/children", "w") as f:
        f.write(f"{{group.pid}} {{same.pid}}")
    time.sleep(60)

def test_starts_and_passes():
    kept = subprocess.Popen(["sleep", "300"], start_new_session=True)
    with open("{pids}/kept", "w") as f:
        f.write(str(kept.pid))
"""


def alive(pid: int) -> bool:
    """Whether pid runs (a zombie, dead but unreaped, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.parametrize("plugin", ["support.leftovers", None])
def test_a_timed_out_test_leaves_no_process_of_its_own(pytester, tmp_path, plugin):
    plugins = f"pytest_plugins = [{plugin!r}]\n" if plugin else ""
    pytester.makeconftest(f"import sys\nsys.path.insert(0, {str(TESTS)!r})\n{plugins}")
    pytester.makepyfile(test_hang=STARTS_AND_HANGS.format(pids=tmp_path))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1, passed=1)
    kept = int((tmp_path / "kept").read_text())
    for _ in range(50):  # the grandchild writes its pid as it starts
        if (tmp_path / "grandchild").exists():
            break
        time.sleep(0.1)
    pids = [int(p) for p in (tmp_path / "children").read_text().split()]
    pids.append(int((tmp_path / "grandchild").read_text()))
    try:
        # Without the plugin they outlive the session (the control: the test can see them).
        assert [alive(pid) for pid in pids] == [plugin is None] * 3
        assert alive(kept)  # a test that passed keeps what it started
    finally:
        for pid in [*pids, kept]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
