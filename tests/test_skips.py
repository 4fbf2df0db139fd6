"""A test that skips on the machine kind CI uses fails the session; elsewhere it stays a skip."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from support.skips import filesystem_of, is_ci_kind, this_machine_is_ci_kind

REPO = Path(__file__).resolve().parent.parent
TESTS = REPO / "tests"


def test_the_ci_kind_is_two_cores_root_and_ext4():
    assert is_ci_kind(2, 0, "ext4")
    assert not is_ci_kind(1, 0, "ext4")
    assert not is_ci_kind(16, 0, "ext4")
    assert not is_ci_kind(None, 0, "ext4")
    assert not is_ci_kind(2, 1000, "ext4")
    assert not is_ci_kind(2, 0, "xfs")


def test_the_checkouts_filesystem_is_the_one_findmnt_names():
    found = subprocess.run(
        ["findmnt", "-n", "-o", "FSTYPE", "-T", str(REPO)], capture_output=True, text=True
    )
    assert found.returncode == 0, found.stderr
    assert filesystem_of(REPO) == found.stdout.strip()


def test_a_skip_fails_the_session_on_the_ci_kind_and_only_there(pytester: pytest.Pytester):
    pytester.makeconftest(
        f"import sys\nsys.path.insert(0, {str(TESTS)!r})\n"
        "from pathlib import Path\nfrom support.skips import SkipPolicy\n"
        "def pytest_configure(config):\n"
        f"    config.pluginmanager.register(SkipPolicy(Path({str(REPO)!r})), 'skips')\n"
    )
    pytester.makepyfile(
        test_some="import pytest\n"
        "def test_runs(): pass\n"
        "def test_skips(): pytest.skip('no frobnicator on this machine')\n"
        "@pytest.mark.xfail(reason='known')\ndef test_expected_to_fail(): assert False\n",
        test_whole="import pytest\npytest.skip('no widget', allow_module_level=True)\n",
    )
    result = pytester.runpytest_subprocess("-rs", "-p", "no:cacheprovider")
    result.stdout.fnmatch_lines(["SKIPPED * no frobnicator on this machine"])
    said = "error: 2 test(s) skipped on the machine kind CI uses (2 cores, root, ext4)"
    if this_machine_is_ci_kind(REPO):
        assert result.ret == pytest.ExitCode.TESTS_FAILED
        where = "where every test must run: test_whole.py, test_some.py::test_skips"
        assert f"{said}, {where}" in result.stdout.str()
    else:
        assert result.ret == pytest.ExitCode.OK
        assert said not in result.stdout.str()
