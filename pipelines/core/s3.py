"""How every S3 client of the pipeline is configured and how its failures read (the model
bucket, the remote cache)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from pipelines.core.errors import PipelineError, Unreachable

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
