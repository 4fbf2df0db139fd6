"""The suite's lanes: a file's tests on one pytest-xdist worker, the ring files on one between
them, one stack for every worker of a session, and the timing tests kept out of the parallel run."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from conftest import (
    LONGEST_FIRST,
    LONGEST_WITHOUT_SERVICES,
    RING_FILES,
    SPLIT_FILES,
    run_order,
    xdist_scope,
)
from support.stack import PORT_VARIABLES, SESSION_ENV, SHARED_STACK, STARTED_BY, started_here

import devstack as local_stack

TESTS = Path(__file__).resolve().parent
# A collection of tests in a fresh pytest process, the suite's configuration and plugins loaded.
COLLECT = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]


def test_a_files_tests_share_a_worker_and_the_ring_files_share_one():
    deploy = xdist_scope("tests/test_deploy.py::test_a[x-y]")
    assert deploy == xdist_scope("tests/test_deploy.py::test_b")
    assert deploy != xdist_scope("tests/test_deploy_ring.py::test_a")
    ringnet, staging = (xdist_scope(f"tests/{name}::test_a") for name in sorted(RING_FILES))
    assert ringnet == staging


def test_a_split_files_builds_go_to_workers_apart_and_the_longest_files_start_first():
    days, years = (f"tests/{sorted(SPLIT_FILES)[0]}::test_b[base-{v}]" for v in ("days", "years"))
    assert xdist_scope(days) != xdist_scope(years)
    assert xdist_scope(days) == xdist_scope(days.replace("::test_b", "::test_c"))
    for name in LONGEST_FIRST + LONGEST_WITHOUT_SERVICES:  # no name gone stale
        assert (TESTS / name).is_file(), name
    files = [("test_a.py", True), ("test_b.py", False), (LONGEST_FIRST[1], True)]
    files += [(LONGEST_FIRST[0], True), (LONGEST_WITHOUT_SERVICES[1], False)]
    files.append((LONGEST_WITHOUT_SERVICES[0], False))
    ordered = [name for name, services in sorted(files, key=lambda f: run_order(*f))]
    assert ordered == [
        LONGEST_FIRST[0],
        LONGEST_FIRST[1],
        "test_a.py",
        LONGEST_WITHOUT_SERVICES[0],
        LONGEST_WITHOUT_SERVICES[1],
        "test_b.py",
    ]


def test_every_file_that_builds_a_ring_is_a_ring_file():
    # A ring takes fixed subnets: two files building one on two workers at once collide.
    building = {
        path.name
        for path in TESTS.glob("test_*.py")
        if re.search(r"\bring_network\(", path.read_text())
    }
    assert building and building <= RING_FILES


def test_every_worker_of_a_session_uses_the_one_stack_it_started(stack):
    if SHARED_STACK:  # started outside the session, never by it
        assert not started_here()
        return
    record = json.loads(STARTED_BY.read_text())
    assert record["session"] == os.environ[SESSION_ENV]
    assert record["environment"] == {name: os.environ[name] for name in PORT_VARIABLES}
    assert stack.s3_url.endswith(f":{os.environ[local_stack.S3_PORT_ENV]}")


def test_the_test_command_runs_the_timing_tests_after_the_rest_in_two_processes_side_by_side():
    lines = (TESTS.parent / "scripts" / "test").read_text().splitlines()
    parallel = next(i for i, line in enumerate(lines) if '-m "not timing"' in line)
    assert " -n " in lines[parallel]
    apart = next(i for i, line in enumerate(lines) if '-m "timing and timing_apart"' in line)
    rest = next(i for i, line in enumerate(lines) if '-m "timing and not timing_apart"' in line)
    assert parallel < apart < rest
    assert lines[apart].endswith("&") and not lines[rest].endswith("&")  # side by side
    assert lines[apart - 1] == "set -m"  # its own process group, its SIGINT the default
    assert " -n " not in lines[apart] + lines[rest]


def test_the_timing_tests_run_apart_are_timing_tests_and_there_are_some():
    files = [str(p) for p in TESTS.glob("test_*.py") if "timing_apart" in p.read_text()]
    apart = subprocess.run([*COLLECT, "-m", "timing_apart", *files], capture_output=True, text=True)
    selected = re.search(r"(\d+)/\d+ tests? collected", apart.stdout)
    assert apart.returncode == 0 and selected and int(selected[1]) >= 1, apart.stdout + apart.stderr
    stray = [*COLLECT, "-m", "timing_apart and not timing", *files]
    assert subprocess.run(stray, capture_output=True, text=True).returncode == 5  # none


def test_a_workers_rewritten_test_modules_are_kept_where_python_writes_no_bytecode():
    # Each worker imports every test module; without kept bytecode it rewrote their asserts
    # anew, 4 to 5 CPU s a worker. This module's rewritten bytecode is removed, then a
    # collection under PYTHONDONTWRITEBYTECODE must write it again (in its usual place: a
    # pycache prefix of its own would compile the whole of pytest anew, 2 CPU s).
    cache = TESTS / "__pycache__"
    for kept in cache.glob("test_lanes.*-pytest-*.pyc"):
        kept.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("PYTHONPYCACHEPREFIX", None)
    result = subprocess.run(
        [*COLLECT, str(TESTS / "test_lanes.py")], env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert list(cache.glob("test_lanes.*-pytest-*.pyc")), sorted(p.name for p in cache.iterdir())
