"""The local stack: S3 (SeaweedFS), an OCI registry and a Docker Engine on 127.0.0.1."""

# Test equipment, not pipeline: `scripts/stack up|down|status` drives it, tests and the `local`
# profile read its endpoints. Everything lives under one folder, $SPARKFORGE_STACK_DIR or
# `.stack/` in the checkout: per service a `<name>.log`, a `<name>.pid` and a data folder, plus
# `endpoints.json` (no secrets) and `s3-credentials.json` (mode 0600). `down` stops only what
# `up` started; an engine found running is used, never stopped. Importing this package loads
# no boto3, docker or requests: those come with the calls that use them.

from devstack.access import (
    docker_client,
    export_s3_environment,
    export_ssh_environment,
    s3_client,
    s3_environment,
)
from devstack.commands import down, status, up
from devstack.files import read_endpoints, s3_credentials
from devstack.settings import (
    REGISTRY_PORT_ENV,
    REPO_ROOT,
    RING_ENV,
    S3_PORT_ENV,
    STACK_DIR_ENV,
    Endpoints,
    ServiceStatus,
    StackError,
    default_stack_dir,
    resolve_dir,
    s3_ports,
)

__all__ = [
    "REGISTRY_PORT_ENV",
    "REPO_ROOT",
    "RING_ENV",
    "S3_PORT_ENV",
    "STACK_DIR_ENV",
    "Endpoints",
    "ServiceStatus",
    "StackError",
    "default_stack_dir",
    "docker_client",
    "down",
    "export_s3_environment",
    "export_ssh_environment",
    "read_endpoints",
    "resolve_dir",
    "s3_client",
    "s3_credentials",
    "s3_environment",
    "s3_ports",
    "status",
    "up",
]
