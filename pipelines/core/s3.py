"""How every S3 client of the pipeline is configured and how its failures read (the model
bucket, the remote cache)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import threading
from collections.abc import Iterator
from functools import cache
from typing import TYPE_CHECKING, Any

from pipelines.core.errors import PipelineError, Unreachable

if TYPE_CHECKING:
    import boto3

# S3-compatible stores (SeaweedFS, MinIO, Ceph) reject or mishandle the newer default checksums.
# Plain values, no botocore here: each client's module imports botocore itself, when it runs. So
# the type is not botocore.config.Config's keyword TypedDicts (private to its stubs): Config
# checks the values when a client is made.
S3_CLIENT_OPTIONS: dict[str, Any] = dict(
    s3={"addressing_style": "path"},
    request_checksum_calculation="when_required",
    response_checksum_validation="when_required",
    retries={"max_attempts": 5, "mode": "standard"},
    connect_timeout=10,
)

# The model bucket's clients (the weights stage's, the local stack's that tests fill it with):
# a range of a large file may take its time on a loaded store.
MODEL_S3_OPTIONS: dict[str, Any] = {**S3_CLIENT_OPTIONS, "read_timeout": 120}


def describe_s3_error(err: Exception, what: str) -> str:
    """One line for a failed S3 call: unreachable, denied, or missing."""
    import botocore.exceptions

    if isinstance(err, botocore.exceptions.EndpointConnectionError):
        return f"{what}: S3 endpoint unreachable ({err.kwargs.get('endpoint_url')})"
    if isinstance(err, botocore.exceptions.ClientError):
        code = err.response.get("Error", {}).get("Code", "?")
        return f"{what}: S3 said {code}"
    return f"{what}: {type(err).__name__}: {err}"


@contextlib.contextmanager
def s3_errors(what: str, unreachable: type[Unreachable] = Unreachable) -> Iterator[None]:
    """A failed S3 call inside the block as one line about what: `unreachable` when no endpoint
    answers (the caller's kind of it), PipelineError otherwise."""
    import botocore.exceptions

    try:
        yield
    except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as err:
        down = isinstance(err, botocore.exceptions.EndpointConnectionError)
        raise (unreachable if down else PipelineError)(describe_s3_error(err, what)) from None


# boto3 sessions are not thread-safe: clients are made from the shared one under this lock,
# and what is held back (held_back) is held under it too, so no thread of ours imports it
# meanwhile. Reentrant: a session is made, and botocore loaded, while a client is being made.
_MAKING_CLIENT = threading.RLock()


@contextlib.contextmanager
def held_back(name: str) -> Iterator[None]:
    """Inside the block `import name` fails (ModuleNotFoundError), where this process has not
    loaded it yet: for a library that loads a module only to offer what this project never
    uses."""
    with _MAKING_CLIENT:
        if name in sys.modules:
            yield
            return
        sys.modules[name] = None  # type: ignore[assignment]  # the import system's "absent"
        try:
            yield
        finally:
            if sys.modules.get(name, False) is None:
                del sys.modules[name]


def load_botocore() -> None:
    """Load botocore's HTTP layer without urllib3's pyOpenSSL module.

    botocore imports that module (and so pyOpenSSL: 0.06 s of a process's first S3 client
    alone, 0.025 s of a build restored from the remote cache, which loads part of it anyway)
    only to take urllib3's own SSLContext from it, and takes the same class from
    urllib3.util.ssl_ when the import fails.
    """
    if "botocore.httpsession" not in sys.modules:
        with held_back("urllib3.contrib.pyopenssl"):
            import botocore.httpsession  # noqa: F401


def client_config(**options: Any) -> Any:
    """A botocore Config of options (botocore loaded as load_botocore does)."""
    load_botocore()
    import botocore.config

    return botocore.config.Config(**options)


def shared_session() -> boto3.session.Session:
    """The process's boto3 session for the AWS chain the environment names now.

    Every S3 client of a run is made from it: the service model and the credentials are loaded
    once, not per client (a second session was 0.08 s of a build restored from the remote
    cache). Another AWS_* environment (a test's, in one process) gets a session of its own; the
    sessions are told apart by a digest, so no copy of a secret is kept beside os.environ.
    """
    chain = sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_"))
    return _session(hashlib.sha256(json.dumps(chain).encode()).hexdigest())


@cache
def _session(chain_digest: str) -> boto3.session.Session:
    """A boto3 session, one per digest of the AWS_* environment."""
    load_botocore()
    import boto3

    return boto3.session.Session()


def chain_has_credentials() -> bool:
    """Whether the standard AWS chain finds credentials."""
    with _MAKING_CLIENT:
        return shared_session().get_credentials() is not None


def make_client(config: Any) -> Any:
    """An S3 client of the shared session with a botocore Config."""
    with _MAKING_CLIENT:
        return shared_session().client("s3", config=config)
