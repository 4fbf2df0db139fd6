"""The synthetic model in the stack's bucket (a module fixture, one upload per test module), an
empty blob store, and a fetch without a display: what the weights tests share."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator

import pytest

from pipelines.core.progress import NoProgress
from pipelines.engine.statcache import StatCache
from pipelines.stages.weights.blobs import BlobStore
from pipelines.stages.weights.bucket import hash_bucket
from pipelines.stages.weights.fetch import fetch_lock
from pipelines.stages.weights.options import FetchOptions
from pipelines.stages.weights.synthetic import (
    SyntheticShape,
    upload_synthetic,
)


def fetch(client, lock, blobs, **options):
    """fetch_lock without a progress display."""
    return fetch_lock(client, lock, blobs, FetchOptions(**options), progress_factory=NoProgress)


def delete_prefix(client, bucket: str, prefix: str) -> None:
    """Delete every object under prefix (what a test put in the shared bucket), then the
    folders SeaweedFS keeps for them (deepest first; elsewhere a no-op)."""
    folders = {prefix}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        keys = [obj["Key"] for obj in page.get("Contents", [])]
        if keys:
            objects = [{"Key": key} for key in keys]
            client.delete_objects(Bucket=bucket, Delete={"Objects": objects, "Quiet": True})
        folders.update(key[: i + 1] for key in keys for i, c in enumerate(key) if c == "/")
    for folder in sorted(folders, key=len, reverse=True):
        client.delete_object(Bucket=bucket, Key=folder)


@contextlib.contextmanager
def fresh_source(s3, kind: str) -> Iterator[str]:
    """A model source under a fresh prefix of the models bucket, emptied afterwards."""
    prefix = f"{kind}-{uuid.uuid4().hex[:8]}"
    try:
        yield f"s3://models/{prefix}/DeepSeek-V4.1-Flash-synthetic"
    finally:
        delete_prefix(s3, "models", f"{prefix}/")


# A source that already holds the synthetic model, to use instead of uploading one per module
# (tests/perf/mutation.py uploads it once for its hundreds of runs); left as it is.
SHARED_SYNTHETIC = "SPARKFORGE_TEST_SYNTHETIC"


@pytest.fixture(scope="module")
def synthetic(s3):
    """The synthetic model uploaded under a fresh prefix (deleted afterwards), and the lock
    made from the bucket."""
    with contextlib.ExitStack() as cleanup:
        source = os.environ.get(SHARED_SYNTHETIC)
        if not source:
            source = cleanup.enter_context(fresh_source(s3, "test"))
            upload_synthetic(s3, source, SyntheticShape())
        yield source, hash_bucket(s3, "dsv41-flash-synthetic", source, previous=None)


@pytest.fixture
def blobs(tmp_path):
    """An empty blob store with its own stat cache."""
    return BlobStore(tmp_path / "weights", StatCache(tmp_path / "statcache.sqlite3"))
