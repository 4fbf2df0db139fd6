"""The tests' own local stack: started once per session by the first pytest-xdist worker that
needs it, shared by the others, stopped by the controller (tests/conftest.py's hooks); and the
fixtures that reach it."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from pathlib import Path

import pytest
from support.ports import spare_stack_ports

import devstack as local_stack
from devstack.settings import ENGINE_ENV, SSH_PORT_ENV

# The tests' stack lives apart from the one `scripts/main` left running (`.stack/`): its own
# folder, ports and engines, so a user's deployment is never touched by a test. Set for the whole
# session, before anything reads it: every doit the tests run finds this stack's endpoints.
# SPARKFORGE_TEST_STACK_DIR names a running stack to use as it is instead, never started or
# stopped here: parallel runs that share one (tests/perf/mutation.py).
SHARED_STACK_ENV = "SPARKFORGE_TEST_STACK_DIR"
SHARED_STACK = os.environ.get(SHARED_STACK_ENV, "")
TEST_STACK_DIR = Path(SHARED_STACK or local_stack.REPO_ROOT / ".stack-test").absolute()
os.environ[local_stack.STACK_DIR_ENV] = str(TEST_STACK_DIR)
PORT_ATTEMPTS = 5
# One test session, however many pytest-xdist workers it runs in: the controller names it before
# the workers start (they inherit its environment), and the first worker that needs the stack
# starts it for all of them, recording the session's name and the port variables it chose.
SESSION_ENV = "SPARKFORGE_TEST_SESSION"
STARTED_BY = TEST_STACK_DIR / "session.json"
PORT_VARIABLES = (local_stack.S3_PORT_ENV, local_stack.REGISTRY_PORT_ENV, SSH_PORT_ENV)


def stopped_stack(directory: Path) -> None:
    """A stack folder's services stopped, its logs gone (they tell the next start's port
    collisions)."""
    local_stack.down(directory)
    for log in directory.glob("*.log"):
        log.unlink()


def start_stack(directory: Path, **variables: str) -> dict[str, str]:
    """A stack in directory on spare ports, anew (what a killed session left is stopped
    first); the port variables it runs on. `variables` hold for the start only."""
    local_stack.down(directory)
    for attempt in range(1, PORT_ATTEMPTS + 1):
        for log in directory.glob("*.log"):
            log.unlink()  # the logs in the folder are this attempt's
        ports = dict(zip(PORT_VARIABLES, map(str, spare_stack_ports()), strict=True))
        try:
            with pytest.MonkeyPatch.context() as env:
                # Never an engine the user runs: the reproducibility tests wipe an engine's
                # images. For this start only: the stack tests' second stacks use a foreign one.
                for name, value in {**ports, ENGINE_ENV: "own", **variables}.items():
                    env.setenv(name, value)
                local_stack.up(directory)
            return ports
        except local_stack.StackError:
            # Another go on other ports: a spare port taken between the check and the bind, or
            # (seen once, with four stacks starting on two busy cores) weed exiting with code 1
            # while it starts. The last failure is raised with its logs left to read.
            local_stack.down(directory)
            if attempt == PORT_ATTEMPTS:
                raise
    raise AssertionError("unreachable: the last attempt returns or raises")


def started_here() -> bool:
    """Whether the stack running from the tests' folder was started by this session."""
    try:
        record = json.loads(STARTED_BY.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and record.get("session") == os.environ[SESSION_ENV]


# Room a run of the suite needs beside its stack (S3 volumes, registry blobs, engines' images,
# stores; measured in the session note): with less, SeaweedFS stops
# taking writes and dozens of unrelated-looking S3 failures follow.
NEEDED_FREE = 4 << 30


def free_space_shortfall(folder: Path, needed: int = NEEDED_FREE) -> str | None:
    """One line when the disk holding folder has less than needed free; None when it has room."""
    free = shutil.disk_usage(folder).free
    if free >= needed:
        return None
    return (
        f"{folder}: {free / 2**30:.1f} GiB free on its disk, the tests' stack needs"
        f" {needed / 2**30:.0f} GiB: free some space (old clones, /tmp/pytest-of-*) and run again"
    )


def session_stack() -> local_stack.Endpoints:
    """The stack of this session: started by the first worker to ask, then shared."""
    TEST_STACK_DIR.mkdir(mode=0o700, parents=True, exist_ok=True)
    if (shortfall := free_space_shortfall(TEST_STACK_DIR, NEEDED_FREE)) is not None:
        raise local_stack.StackError(shortfall)
    with (TEST_STACK_DIR / "session.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the workers wait here while the first one starts it
        if started_here():
            os.environ.update(json.loads(STARTED_BY.read_text())["environment"])
            return local_stack.read_endpoints()
        chosen = start_stack(TEST_STACK_DIR)
        # Every doit a test runs finds this stack's ports (devstack reads them from here).
        os.environ.update(chosen)
        STARTED_BY.write_text(
            json.dumps({"session": os.environ[SESSION_ENV], "environment": chosen})
        )
        return local_stack.read_endpoints()


def stop_if_started_here() -> None:
    """Stop the tests' stack if this session started it (the controller, once all are done)."""
    if not SHARED_STACK and started_here():
        local_stack.down()
        STARTED_BY.unlink(missing_ok=True)


@pytest.fixture(scope="session")
def stack():
    """The tests' own stack's Endpoints, started once for every worker of the session and
    stopped when the session ends (its logs kept for a look at what failed), or the shared
    one, as it is."""
    if SHARED_STACK:
        yield local_stack.read_endpoints()
        return
    yield session_stack()


@pytest.fixture(scope="module")
def private_stack(stack, tmp_path_factory):
    """The endpoints of a stack of one module's own, for tests that wipe its engine's images or
    watch its events while the other workers build and run on the session's engine."""
    directory = tmp_path_factory.mktemp("engine")
    start_stack(directory, **{local_stack.RING_ENV: "off"})
    yield local_stack.read_endpoints(directory)
    stopped_stack(directory)


@pytest.fixture(scope="module")
def private_engine(private_stack):
    """A Docker client for the module's own engine (private_stack's)."""
    client = local_stack.docker_client(private_stack)
    yield client
    client.close()


@pytest.fixture(scope="session")
def s3(stack):
    """A boto3 S3 client for the stack's S3, signed with the stack's keys."""
    client = local_stack.s3_client(stack, local_stack.s3_credentials())
    yield client
    client.close()


@pytest.fixture(scope="session")
def stack_env(stack):
    """Environment variables pointing the standard AWS chain at the stack's S3 (subprocesses)."""
    return local_stack.s3_environment(stack, local_stack.s3_credentials())


@pytest.fixture
def s3_in_environment(stack_env, monkeypatch):
    """The stack's S3 for the standard AWS chain of this process (the remote cache's client)."""
    for name, value in stack_env.items():
        monkeypatch.setenv(name, value)


@pytest.fixture(scope="session")
def docker_client(stack):
    """A Docker SDK client for the stack's engine."""
    client = local_stack.docker_client(stack)
    yield client
    client.close()
