"""A fetch's ranges against answers that break or are not what was asked: dropped connections,
ranges that keep breaking, waits, rate limits, a whole body for a range, a replaced object."""

from __future__ import annotations

import hashlib
import http.server
import os
import socket
import time

import pytest
from support import http_double
from support.cutting_proxy import CuttingProxy
from support.model_bucket import fetch, fresh_source

from pipelines.core.modellock import (
    Lock,
    LockEntry,
)
from pipelines.core.progress import NoProgress
from pipelines.core.s3 import MODEL_S3_OPTIONS, client_config
from pipelines.stages.weights import bucket as bucket_module
from pipelines.stages.weights import fetch as fetch_module
from pipelines.stages.weights import ranges as ranges_module
from pipelines.stages.weights.bucket import hash_bucket
from pipelines.stages.weights.fetch import FetchError, RateLimiter
from pipelines.stages.weights.ranges import RangeError
from pipelines.stages.weights.s3 import S3Url

BIG = "model-00047-of-00048.safetensors"


def proxied_client(proxy: CuttingProxy, stack, stack_env):
    """A boto3 client for the stack's S3 through the proxy, as the pipeline configures one."""
    import boto3  # loaded by the tests that make a client, not by every worker's collection

    return boto3.session.Session().client(
        "s3",
        endpoint_url=f"http://127.0.0.1:{proxy.port}",
        region_name=stack.s3_region,
        aws_access_key_id=stack_env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=stack_env["AWS_SECRET_ACCESS_KEY"],
        config=client_config(max_pool_connections=4, **MODEL_S3_OPTIONS),
    )


def test_dropped_connections_are_retried_and_the_file_still_verifies(
    synthetic, blobs, stack, stack_env
):
    _, lock = synthetic
    entry = lock.entry(BIG)
    one = Lock(model=lock.model, source=lock.source, files=[entry])
    proxy = CuttingProxy(int(stack.s3_url.rsplit(":", 1)[1]))
    client = proxied_client(proxy, stack, stack_env)
    try:
        report = fetch(client, one, blobs, part_size=1 << 20, workers=4)
    finally:
        proxy.close()
    assert proxy.cuts > 0
    assert report.fetched == [BIG]
    assert report.downloaded > entry.size  # the cut ranges came again
    assert blobs.is_intact(entry.sha256, entry.size)


def fetch_with_every_range_cut(
    lock: Lock, blobs, stack, stack_env, retries: int
) -> tuple[CuttingProxy, pytest.ExceptionInfo[FetchError]]:
    """A one-range-at-a-time fetch of lock through a proxy that cuts every connection: the
    proxy (its cuts counted) and the FetchError the fetch ends with."""
    proxy = CuttingProxy(int(stack.s3_url.rsplit(":", 1)[1]), every=1)
    try:
        with pytest.raises(FetchError) as err:
            fetch(
                proxied_client(proxy, stack, stack_env),
                lock,
                blobs,
                part_size=1 << 20,
                workers=1,
                ahead=1,
                retries=retries,
            )
    finally:
        proxy.close()
    return proxy, err


def test_a_range_that_keeps_breaking_fails_in_one_line_naming_bytes_and_tries(
    synthetic, blobs, stack, stack_env
):
    source, lock = synthetic
    one = Lock(model=lock.model, source=source, files=[lock.entry(BIG)])
    proxy, err = fetch_with_every_range_cut(one, blobs, stack, stack_env, retries=1)
    key = S3Url.parse(source).key(BIG)
    assert str(err.value) == f"{key}: bytes 0-1048575 broke 2 times (IncompleteRange)"
    assert proxy.cuts == 2
    assert blobs.missing(one) == one.files


class FakeClock:
    """A clock that moves only when slept on, recording each sleep."""

    def __init__(self):
        self.now = 1000.0
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def test_a_broken_range_is_retried_after_doubling_waits_capped_at_5_seconds(
    synthetic, blobs, stack, stack_env, monkeypatch
):
    source, lock = synthetic
    one = Lock(model=lock.model, source=source, files=[lock.entry(BIG)])
    clock = FakeClock()
    monkeypatch.setattr(ranges_module, "time", clock)
    proxy, err = fetch_with_every_range_cut(one, blobs, stack, stack_env, retries=6)
    assert "broke 7 times" in str(err.value)
    assert proxy.cuts == 7
    assert clock.sleeps == pytest.approx([0.2, 0.4, 0.8, 1.6, 3.2, 5.0])


def test_a_rate_limit_makes_each_read_wait_until_the_bytes_before_it_are_paid(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(fetch_module, "time", clock)
    limiter = RateLimiter(1000.0)
    limiter.take(500)  # the first read owes nothing yet
    assert clock.sleeps == []
    limiter.take(500)
    limiter.take(2000)
    assert clock.sleeps == pytest.approx([0.5, 0.5])
    clock.now += 10  # idle: the 2000 bytes are paid, and idle time is no credit for a burst
    limiter.take(1000)
    limiter.take(1000)
    assert clock.sleeps == pytest.approx([0.5, 0.5, 1.0])
    unlimited = RateLimiter(None)
    unlimited.take(10**9)
    assert clock.sleeps == pytest.approx([0.5, 0.5, 1.0])


class WholeBody(http.server.BaseHTTPRequestHandler):
    """An endpoint (or proxy) that ignores Range: every GET gets 200 and the whole object."""

    body = b""

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.body)))
        self.send_header("ETag", f'"{hashlib.md5(self.body).hexdigest()}"')
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args) -> None:
        pass


def client_for(endpoint: str, max_attempts: int = 5):
    """A boto3 client as the pipeline configures one, for endpoint, with test keys."""
    import boto3

    return boto3.session.Session().client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="test",
        aws_secret_access_key="test",
        config=client_config(
            **{**MODEL_S3_OPTIONS, "retries": {"max_attempts": max_attempts, "mode": "standard"}}
        ),
    )


def test_an_endpoint_that_ignores_range_fails_in_one_line_and_nothing_is_locked_or_stored(
    blobs, monkeypatch
):
    data = os.urandom(3 << 20)
    handler = type("Handler", (WholeBody,), {"body": data})
    server = http_double.QuietHTTPServer(("127.0.0.1", 0), handler)
    http_double.start(server)
    try:
        client = client_for(f"http://127.0.0.1:{server.server_port}")
        url = S3Url.parse("s3://models/ignores-range/m")
        entry = LockEntry(name="w.bin", size=len(data), sha256=hashlib.sha256(data).hexdigest())
        lock = Lock(model="m", source="s3://models/ignores-range/m", files=[entry])
        expected = (
            "ignores-range/m/w.bin: asked for bytes 0-1048575/3145728, S3 answered HTTP 200"
            " with Content-Range None"
        )
        with pytest.raises(FetchError) as err:
            fetch(client, lock, blobs, part_size=1 << 20)
        assert str(err.value) == expected
        assert blobs.missing(lock) == [entry]
        monkeypatch.setattr(bucket_module, "RANGE", 1 << 20)  # hash_bucket's, scaled down
        listed = {"size": len(data), "etag": "x"}
        with pytest.raises(RangeError) as err:
            bucket_module.hash_object(client, url, "w.bin", listed, NoProgress())
        assert str(err.value) == expected
    finally:
        server.shutdown()
        server.server_close()


def test_an_unreachable_endpoint_stops_the_fetch_in_one_line_naming_it(synthetic, blobs):
    _, lock = synthetic
    with socket.create_server(("127.0.0.1", 0)) as closed:
        port = closed.getsockname()[1]  # nothing listens there once it is closed
    started = time.monotonic()
    with pytest.raises(FetchError) as err:
        fetch(client_for(f"http://127.0.0.1:{port}", max_attempts=2), lock, blobs)
    assert str(err.value) == f"S3 endpoint http://127.0.0.1:{port}: unreachable" + (
        " (EndpointConnectionError)"
    )
    assert time.monotonic() - started < 30
    assert os.listdir(blobs.blobs) == []


def test_an_object_replaced_while_it_is_locked_fails_in_one_line(s3, monkeypatch):
    # Of one size: the range's Content-Range cannot tell them apart, only the ETag can.
    old, new = os.urandom(3 << 20), os.urandom(3 << 20)
    listed = bucket_module.list_objects

    def replaced_after_listing(client, url: S3Url) -> dict[str, dict]:
        objects = listed(client, url)
        client.put_object(Bucket=url.bucket, Key=url.key("w.bin"), Body=new)
        return objects

    monkeypatch.setattr(bucket_module, "list_objects", replaced_after_listing)
    with fresh_source(s3, "replaced") as source:
        url = S3Url.parse(source)
        etag = s3.put_object(Bucket=url.bucket, Key=url.key("w.bin"), Body=old)["ETag"].strip('"')
        with pytest.raises(RangeError) as err:
            hash_bucket(s3, "m", source, previous=None)
    key = url.key("w.bin")
    assert str(err.value) == f"{key}: replaced while it was read (its ETag is no longer {etag})"
