"""How callers reach a running stack: the AWS chain's variables, a boto3 client, a Docker client."""

# boto3 and docker are imported inside the functions that use them: dodo.py calls
# export_s3_environment on every start, and `doit list` must not pay for them.

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from devstack.files import read_endpoints, s3_credentials
from devstack.settings import Endpoints, StackError

if TYPE_CHECKING:
    import docker
    from types_boto3_s3 import S3Client


def s3_environment(endpoints: Endpoints, credentials: Mapping[str, str]) -> dict[str, str]:
    """Variables that point the standard AWS chain (boto3, aws CLI, s5cmd) at the stack's S3."""
    return {
        **credentials,
        "AWS_ENDPOINT_URL_S3": endpoints.s3_url,
        "AWS_DEFAULT_REGION": endpoints.s3_region,
    }


def export_s3_environment(stack_dir: Path | str | None = None) -> None:
    """Point this process's AWS chain at the running stack's S3; keys only where none are set."""
    # A no-op while the stack is down, so `doit list` still works; S3 calls then fail with
    # "no S3 credentials", which names `scripts/stack up`.
    try:
        endpoints = read_endpoints(stack_dir)
        credentials = s3_credentials(stack_dir)
    except StackError:
        return
    environment = s3_environment(endpoints, credentials)
    os.environ["AWS_ENDPOINT_URL_S3"] = environment["AWS_ENDPOINT_URL_S3"]
    os.environ.setdefault("AWS_DEFAULT_REGION", environment["AWS_DEFAULT_REGION"])
    if "AWS_ACCESS_KEY_ID" not in os.environ and "AWS_PROFILE" not in os.environ:
        os.environ.update(credentials)


def export_ssh_environment(stack_dir: Path | str | None = None) -> None:
    """Point the pipeline's ssh at the stack's key and sshd host key, where none are set."""
    try:
        endpoints = read_endpoints(stack_dir)
    except StackError:
        return
    if endpoints.ssh_identity:
        os.environ.setdefault("SPARKFORGE_SSH_IDENTITY", endpoints.ssh_identity)
        os.environ.setdefault("SPARKFORGE_SSH_KNOWN_HOSTS", endpoints.ssh_known_hosts)


def s3_client(endpoints: Endpoints, credentials: Mapping[str, str]) -> S3Client:
    """A boto3 S3 client for the stack's S3 (path-style, checksums only when required)."""
    import boto3
    from botocore.config import Config

    # The pipeline's own client settings, so tests reach the stack's S3 as the pipeline does.
    from pipelines.core.s3 import MODEL_S3_OPTIONS

    config = Config(region_name=endpoints.s3_region, max_pool_connections=32, **MODEL_S3_OPTIONS)
    return boto3.session.Session().client(
        "s3",
        endpoint_url=endpoints.s3_url,
        region_name=endpoints.s3_region,
        aws_access_key_id=credentials["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=credentials["AWS_SECRET_ACCESS_KEY"],
        config=config,
    )


def docker_client(endpoints: Endpoints) -> docker.DockerClient:
    """A Docker SDK client for the stack's engine."""
    import docker

    return docker.DockerClient(base_url=endpoints.docker_host)
