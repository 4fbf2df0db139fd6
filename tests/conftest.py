"""Shared fixtures: the local stack of real services on 127.0.0.1 (devstack/)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

import devstack as local_stack
from devstack.settings import ENGINE_ENV

# The measurement helpers of tests/perf/ (read_chars, the full-size model shape) serve the tests.
sys.path.insert(0, str(Path(__file__).resolve().parent / "perf"))


@pytest.fixture(scope="session")
def stack():
    """The local stack's Endpoints; stopped at the end only where this session started it."""
    before = {s.name for s in local_stack.status() if s.state in ("running", "unhealthy")}
    # The reproducibility test wipes the engine's images: only ever the stack's own engine.
    # Set for this call only: the stack tests' second stacks use a foreign engine on purpose.
    before_env = os.environ.get(ENGINE_ENV)
    os.environ[ENGINE_ENV] = "own"
    try:
        endpoints = local_stack.up()
    finally:
        if before_env is None:
            os.environ.pop(ENGINE_ENV)
        else:
            os.environ[ENGINE_ENV] = before_env
    yield endpoints
    started_here = [name for name in endpoints.started if name not in before]
    if started_here:
        local_stack.down(services=started_here)


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
