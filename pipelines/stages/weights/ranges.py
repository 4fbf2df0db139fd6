"""One ranged GET with retries, shared by fetch and lock_weights.

botocore already retries a request that fails before its body starts (connection refused,
throttling, 5xx: `retries` in s3options.MODEL_S3_OPTIONS); it does not retry a body that breaks
while it streams. So this loop retries only broken bodies, and a failed request is not retried
again on top of botocore's attempts.
"""

from __future__ import annotations

import http.client
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypedDict, cast

import botocore.exceptions
import urllib3.exceptions

from pipelines.core.errors import PipelineError
from pipelines.core.s3 import describe_s3_error
from pipelines.stages.weights.s3 import S3Url

if TYPE_CHECKING:
    from types_boto3_s3 import S3Client
    from types_boto3_s3.type_defs import GetObjectOutputTypeDef


class IfMatch(TypedDict, total=False):
    """get_object's condition that the object is still the one listed."""

    IfMatch: str


READ_CHUNK = 4 << 20
RETRIES = 5
# What a body that breaks mid-stream raises, through botocore, urllib3 or http.client directly.
BROKEN_BODY = (
    botocore.exceptions.BotoCoreError,
    urllib3.exceptions.HTTPError,
    http.client.HTTPException,
    ConnectionError,
    TimeoutError,
)


class RangeError(PipelineError):
    """A range that could not be read (one line: object, bytes, why)."""


class Stopped(RangeError):
    """The fetch was stopped (Ctrl-C, or its source is down): not a fault of this range."""


class SourceDown(RangeError):
    """The S3 endpoint refuses every request, not one object: unreachable, or no access."""


# What S3 says to every request of a bucket alike (bad keys, no access, no such bucket).
ENDPOINT_CODES = {
    "AccessDenied",
    "AllAccessDisabled",
    "ExpiredToken",
    "InvalidAccessKeyId",
    "InvalidToken",
    "NoSuchBucket",
    "SignatureDoesNotMatch",
}


class IncompleteRange(ConnectionError):
    """The server closed a range before all its bytes arrived."""


def read_range(
    client: S3Client,
    url: S3Url,
    name: str,
    start: int,
    view: memoryview,
    size: int,
    retries: int = RETRIES,
    stop: threading.Event | None = None,
    on_bytes: Callable[[int], None] = lambda n: None,
    throttle: Callable[[int], None] | None = None,
    etag: str | None = None,
) -> None:
    """Fill view with the bytes of object name (size bytes long) from start on, retrying a
    broken body.

    on_bytes is told of bytes as they arrive (also those of a broken attempt: they crossed
    the network); throttle (a rate limit) is told of every read; stop ends the read at its next
    chunk; etag, when given, must still be the object's (else it was replaced meanwhile).
    """
    key = url.key(name)
    end = start + len(view) - 1
    pinned: IfMatch = {"IfMatch": f'"{etag}"'} if etag else {}
    for attempt in range(retries + 1):
        if stop is not None and stop.is_set():
            raise Stopped(f"{key}: fetch stopped")
        try:
            response = client.get_object(
                Bucket=url.bucket, Key=key, Range=f"bytes={start}-{end}", **pinned
            )
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as err:
            raise s3_error(client, err, url, key, etag) from None  # botocore retried it
        expected = f"bytes {start}-{end}/{size}"
        if response.get("ContentRange") != expected:
            # An endpoint or proxy that ignores Range answers 200 with the whole object.
            response["Body"].close()
            status = response["ResponseMetadata"]["HTTPStatusCode"]
            raise RangeError(
                f"{key}: asked for {expected}, S3 answered HTTP {status}"
                f" with Content-Range {response.get('ContentRange')!r}"
            )
        try:
            fill(response, view, key, stop, on_bytes, throttle)
            return
        except BROKEN_BODY as err:
            if attempt == retries:
                raise RangeError(
                    f"{key}: bytes {start}-{end} broke {retries + 1} times ({type(err).__name__})"
                ) from None
            time.sleep(min(2**attempt * 0.2, 5))


def s3_error(
    client: S3Client, err: Exception, url: S3Url, key: str, etag: str | None
) -> RangeError:
    """The one line for a failed GET: SourceDown when no other object would fare better."""
    endpoint = client.meta.endpoint_url
    # No NoCredentialsError here: s3_client refuses to make a client without credentials.
    if isinstance(err, botocore.exceptions.ConnectionError):
        return SourceDown(f"S3 endpoint {endpoint}: unreachable ({type(err).__name__})")
    code = getattr(err, "response", {}).get("Error", {}).get("Code")
    if code in ENDPOINT_CODES:
        return SourceDown(f"S3 endpoint {endpoint}: {code} for s3://{url.bucket}/{key}")
    if code == "PreconditionFailed" and etag:
        return RangeError(f"{key}: replaced while it was read (its ETag is no longer {etag})")
    return RangeError(describe_s3_error(err, key))


def fill(
    response: GetObjectOutputTypeDef,
    view: memoryview,
    key: str,
    stop: threading.Event | None,
    on_bytes: Callable[[int], None],
    throttle: Callable[[int], None] | None = None,
) -> None:
    """Read one S3 response body into view (see read_body)."""
    # Not `with response["Body"] as body`: botocore's __enter__ hands out the urllib3 stream,
    # whose readinto reads into a fresh bytes object and copies it (perf of a fetch: 3% of all
    # samples were that copy, and every range took that path).
    try:
        read_body(direct_readinto(response), view, key, stop, on_bytes, throttle)
    finally:
        response["Body"].close()


def read_body(
    readinto: Callable[[memoryview], int],
    view: memoryview,
    key: str,
    stop: threading.Event | None,
    on_bytes: Callable[[int], None],
    throttle: Callable[[int], None] | None = None,
) -> None:
    """Read a body into view, reporting bytes per READ_CHUNK (a cheap loop) and throttling per
    read (a limit must hold within a range, not only between ranges)."""
    got = counted = 0
    try:
        while got < len(view):
            if stop is not None and stop.is_set():
                raise Stopped(f"{key}: fetch stopped")
            n = readinto(view[got : got + READ_CHUNK])
            if not n:
                break
            got += n
            if throttle is not None:
                throttle(n)
            if got - counted >= READ_CHUNK:
                on_bytes(got - counted)
                counted = got
    finally:
        on_bytes(got - counted)
    if got != len(view):
        raise IncompleteRange(f"got {got} of {len(view)} bytes")


def direct_readinto(response: GetObjectOutputTypeDef) -> Callable[[memoryview], int]:
    """The fastest readinto for an S3 body: http.client's own, straight from the socket.

    botocore and urllib3 read through a temporary and copy it (perf: 3% of a fetch's samples;
    our process's CPU 11.8 -> 11.5 s for 4.14 GiB). Identity-encoded bodies can be read from
    the underlying http.client response; anything else falls back to the StreamingBody.
    """
    body = response["Body"]
    raw = getattr(body, "_raw_stream", None)
    http_response = getattr(raw, "_fp", None)
    encoding = response.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("content-encoding")
    if http_response is None or not hasattr(http_response, "readinto") or encoding:
        # botocore's stubs type readinto's argument as IO[bytes]; it takes a writable buffer
        # (io.RawIOBase.readinto), as http.client's does.
        return cast(Callable[[memoryview], int], body.readinto)
    # http.client.HTTPResponse.readinto, found through the body's private attributes above.
    direct: Callable[[memoryview], int] = http_response.readinto
    return direct
