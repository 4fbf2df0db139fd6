"""Hash what the bucket holds: every object streamed through sha256 once, for a new lock."""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, TypedDict

from pipelines.core.modellock import Lock, LockEntry, LockError
from pipelines.core.progress import Progress
from pipelines.stages.weights.ranges import read_range
from pipelines.stages.weights.s3 import S3Url

if TYPE_CHECKING:
    from types_boto3_s3 import S3Client


class Listed(TypedDict):
    """An object as the bucket lists it."""

    size: int
    etag: str  # without its quotes


MD5SUMS = "MD5SUMS.body"
RANGE = 32 << 20


def list_objects(client: S3Client, url: S3Url) -> dict[str, Listed]:
    """Objects directly under the prefix, by file name: size and ETag."""
    found: dict[str, Listed] = {}
    for page in client.get_paginator("list_objects_v2").paginate(
        Bucket=url.bucket, Prefix=url.prefix + "/"
    ):
        for obj in page.get("Contents", []):
            name = obj["Key"][len(url.prefix) + 1 :]
            if "/" not in name:
                found[name] = {"size": obj["Size"], "etag": obj["ETag"].strip('"')}
    return found


def hash_object(
    client: S3Client, url: S3Url, name: str, listed: Listed, progress: Progress
) -> tuple[str, str]:
    """(sha256, md5) of one object as listed (size, ETag), computed while it streams in ranges.

    A range that breaks is fetched again before it is hashed, so a dropped connection on a
    101 GB shard costs one range, not the whole object. Every range must come from the listed
    object (If-Match its ETag): one replaced meanwhile would lock its old size and new bytes.
    """
    size = listed["size"]
    sha, md5 = hashlib.sha256(), hashlib.md5()
    buffer = bytearray(min(RANGE, size))
    for start in range(0, size, RANGE):
        view = memoryview(buffer)[: min(RANGE, size - start)]
        read_range(client, url, name, start, view, size, etag=listed["etag"])
        sha.update(view)
        md5.update(view)
        progress.advance(name, len(view))
    return sha.hexdigest(), md5.hexdigest()


def parse_md5sums(text: str) -> dict[str, str]:
    """MD5SUMS lines ('<md5>  <name>', '*' for binary mode) as name -> md5."""
    sums = {}
    for line in text.splitlines():
        if line.strip():
            md5, _, name = line.partition(" ")
            sums[name.strip().lstrip("*")] = md5.lower()
    return sums


def hash_bucket(
    client: S3Client, model: str, source: str, previous: Lock | None, workers: int = 4
) -> Lock:
    """A lock of every object under source, cross-checked against MD5SUMS.body if shipped.

    The previous lock's file order is kept; names it lists that the bucket lacks are an error.
    """
    url = S3Url.parse(source)
    objects = list_objects(client, url)
    if not objects:
        raise LockError(f"{source}: no objects under this prefix")
    expected = [e.name for e in previous.files] if previous else []
    absent = [n for n in expected if n not in objects]
    if absent:
        raise LockError(f"{source}: {absent[0]!r} is in the lock but not in the bucket")
    names = expected + sorted(set(objects) - set(expected))
    total = sum(objects[n]["size"] for n in names)
    big = {n: objects[n]["size"] for n in sorted(names, key=lambda n: -objects[n]["size"])[:2]}
    progress = Progress(f"lock {model}", total, big)
    try:
        with ThreadPoolExecutor(workers) as pool:
            hashed = pool.map(lambda n: hash_object(client, url, n, objects[n], progress), names)
            digests = dict(zip(names, hashed, strict=True))
    finally:
        progress.close()
    if MD5SUMS in objects:
        body = client.get_object(Bucket=url.bucket, Key=url.key(MD5SUMS))["Body"].read()
        for name, md5 in parse_md5sums(body.decode()).items():
            if name not in digests:
                raise LockError(f"{source}/{MD5SUMS}: lists {name!r}, which the bucket lacks")
            if digests[name][1] != md5:
                raise LockError(
                    f"{source}/{MD5SUMS}: {name}: md5 {digests[name][1]} does not match"
                    f" upstream's {md5}"
                )
    files = [
        LockEntry(name=n, size=objects[n]["size"], sha256=digests[n][0], etag=objects[n]["etag"])
        for n in names
    ]
    return Lock(model=model, source=source, files=files)
