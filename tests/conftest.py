"""Shared fixtures: a local stack of the tests' own (real services on 127.0.0.1, devstack/)."""

from __future__ import annotations

import os
import sys
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
# pytester: the skip policy's own test runs a small session of its own.
pytest_plugins = ["pytester"]


def stopped_test_stack() -> None:
    """The tests' stack stopped, its logs gone (they tell the next start's port collisions)."""
    local_stack.down()
    for log in TEST_STACK_DIR.glob("*.log"):
        log.unlink()


def start_test_stack() -> local_stack.Endpoints:
    """The tests' stack on spare ports, anew: what a killed session left is stopped first."""
    stopped_test_stack()
    engine_before = os.environ.get(ENGINE_ENV)
    for _ in range(PORT_ATTEMPTS):
        s3_port, registry_port, ssh_port = spare_stack_ports()
        os.environ[local_stack.S3_PORT_ENV] = str(s3_port)
        os.environ[local_stack.REGISTRY_PORT_ENV] = str(registry_port)
        os.environ[SSH_PORT_ENV] = str(ssh_port)
        # Never an engine the user runs: the reproducibility tests wipe the engine's images.
        # Set for this call only: the stack tests' second stacks use a foreign engine on purpose.
        os.environ[ENGINE_ENV] = "own"
        try:
            return local_stack.up()
        except local_stack.StackError as err:
            # A spare port taken between the check and the bind: another go on other ports.
            logs = TEST_STACK_DIR.glob("*.log")
            taken = "already in use" in str(err) or any(
                "address already in use" in log.read_text(errors="replace") for log in logs
            )
            stopped_test_stack()
            if not taken:
                raise
        finally:
            if engine_before is None:
                os.environ.pop(ENGINE_ENV)
            else:
                os.environ[ENGINE_ENV] = engine_before
    pytest.fail(f"spare ports were taken by other processes {PORT_ATTEMPTS} times in a row")


def pytest_configure(config: pytest.Config) -> None:
    """Fail the session for any skip on CI's machine kind (tests/support/skips.py)."""
    config.pluginmanager.register(SkipPolicy(local_stack.REPO_ROOT), "sparkforge-skips")


# Fixtures that start real services: the local stack, and the ring tests' three members
# behind their own S3 in network namespaces (tests/test_weights_ring.py).
SERVICE_FIXTURES = {"stack", "ring"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark `stack` every test that reaches a fixture starting services, however indirectly:
    the fast lane is `pytest -m "not stack"`, which starts none."""
    for item in items:
        if SERVICE_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.stack)


@pytest.fixture(scope="session")
def stack():
    """The tests' own stack's Endpoints; started here and stopped at the end of the session
    (its logs kept for a look at what failed), or the shared one, as it is."""
    if SHARED_STACK:
        yield local_stack.read_endpoints()
        return
    endpoints = start_test_stack()
    yield endpoints
    local_stack.down()


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
