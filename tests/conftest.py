"""Shared fixtures: a local stack of the tests' own (real services on 127.0.0.1, devstack/)."""

from __future__ import annotations

import fcntl
import json
import os
import sys
import uuid
from pathlib import Path

import pytest

import devstack as local_stack
from devstack.settings import ENGINE_ENV, SSH_PORT_ENV

# The measurement helpers of tests/perf/ (read_chars, the full-size model shape) serve the tests.
sys.path.insert(0, str(Path(__file__).resolve().parent / "perf"))

from support.ports import spare_stack_ports  # noqa: E402  (tests/ is on the path from here)
from support.skips import SkipPolicy  # noqa: E402

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
# pytester: the skip policy's own test runs a small session of its own. support.deploying and
# support.model_bucket: the deploy and weights tests' fixtures, module ones made per test module.
pytest_plugins = ["pytester", "support.deploying", "support.model_bucket"]


def stopped_stack(directory: Path) -> None:
    """A stack folder's services stopped, its logs gone (they tell the next start's port
    collisions)."""
    local_stack.down(directory)
    for log in directory.glob("*.log"):
        log.unlink()


def start_stack(directory: Path, **variables: str) -> dict[str, str]:
    """A stack in directory on spare ports, anew (what a killed session left is stopped
    first); the port variables it runs on. `variables` hold for the start only."""
    stopped_stack(directory)
    for _ in range(PORT_ATTEMPTS):
        ports = dict(zip(PORT_VARIABLES, map(str, spare_stack_ports()), strict=True))
        try:
            with pytest.MonkeyPatch.context() as env:
                # Never an engine the user runs: the reproducibility tests wipe an engine's
                # images. For this start only: the stack tests' second stacks use a foreign one.
                for name, value in {**ports, ENGINE_ENV: "own", **variables}.items():
                    env.setenv(name, value)
                local_stack.up(directory)
            return ports
        except local_stack.StackError as err:
            # A spare port taken between the check and the bind: another go on other ports.
            logs = directory.glob("*.log")
            taken = "already in use" in str(err) or any(
                "address already in use" in log.read_text(errors="replace") for log in logs
            )
            stopped_stack(directory)
            if not taken:
                raise
    pytest.fail(f"spare ports were taken by other processes {PORT_ATTEMPTS} times in a row")


def is_controller(config: pytest.Config) -> bool:
    """Whether this process runs the session itself (alone, or as pytest-xdist's controller)."""
    return not hasattr(config, "workerinput")


def pytest_configure(config: pytest.Config) -> None:
    """Name the session; fail it for any skip on CI's machine kind (tests/support/skips.py)."""
    if is_controller(config):
        os.environ[SESSION_ENV] = uuid.uuid4().hex
    config.pluginmanager.register(SkipPolicy(local_stack.REPO_ROOT), "sparkforge-skips")


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Stop the tests' stack once every worker is done, if this session started it."""
    if is_controller(session.config) and not SHARED_STACK and started_here():
        local_stack.down()
        STARTED_BY.unlink(missing_ok=True)


def started_here() -> bool:
    """Whether the stack running from the tests' folder was started by this session."""
    try:
        record = json.loads(STARTED_BY.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and record.get("session") == os.environ[SESSION_ENV]


def session_stack() -> local_stack.Endpoints:
    """The stack of this session: started by the first worker to ask, then shared."""
    TEST_STACK_DIR.mkdir(mode=0o700, parents=True, exist_ok=True)
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


# Fixtures that start real services: the local stack, and the ring tests' three members
# behind their own S3 in network namespaces (tests/test_weights_ring.py).
SERVICE_FIXTURES = {"stack", "ring"}


# Files whose tests build a ring in network namespaces: one ring at a time fits on a host (its
# subnets are fixed), so pytest-xdist runs these files on one worker, one after the other.
RING_FILES = {"test_ringnet.py", "test_weights_ring.py"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark `stack` every test that reaches a fixture starting services, however indirectly
    (the fast lane is `pytest -m "not stack"`, which starts none); then put the files with such
    tests first, each file's tests in their order: pytest-xdist hands files out in this order,
    and the long ones started last would run on alone at the end."""
    for item in items:
        if SERVICE_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.stack)
    with_services = {item.path for item in items if item.get_closest_marker("stack")}
    items.sort(key=lambda item: item.path not in with_services)


def xdist_scope(nodeid: str) -> str:
    """The scope pytest-xdist keeps on one worker: a test's file (its module fixtures are made
    once), the ring files together."""
    path = nodeid.split("::", 1)[0]
    return "ring files" if Path(path).name in RING_FILES else path


def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """pytest-xdist's scheduling by scope, with xdist_scope as the scope."""
    from xdist.scheduler import LoadScopeScheduling

    class ByFile(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_scope(nodeid)

    return ByFile(config, log)


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
def private_engine(stack, tmp_path_factory):
    """A Docker client for an engine of one module's own, for tests that wipe an engine's
    images while the other workers build and run on the session's engine."""
    directory = tmp_path_factory.mktemp("engine")
    start_stack(directory, **{local_stack.RING_ENV: "off"})
    client = local_stack.docker_client(local_stack.read_endpoints(directory))
    yield client
    client.close()
    stopped_stack(directory)


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


@pytest.fixture(scope="session")
def docker_client(stack):
    """A Docker SDK client for the stack's engine."""
    client = local_stack.docker_client(stack)
    yield client
    client.close()


def delete_repository(registry: str, repository: str) -> None:
    """Delete every manifest a repository's tags point to (the stack's registry allows it)."""
    import requests

    from pipelines.images.registry import ACCEPT

    base = f"http://{registry}/v2/{repository}"
    tags = requests.get(f"{base}/tags/list", timeout=10).json().get("tags") or []
    digests = {
        requests.head(f"{base}/manifests/{tag}", headers={"Accept": ACCEPT}, timeout=10).headers[
            "Docker-Content-Digest"
        ]
        for tag in tags
    }
    for digest in digests:
        requests.delete(f"{base}/manifests/{digest}", timeout=10).raise_for_status()
