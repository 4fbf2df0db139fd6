"""The remote cache: step outputs in an S3-compatible bucket, shared by runners that start empty.

Layout under s3://BUCKET/PREFIX: `objects/sha256/<hex>` (file bytes, content-addressed, written
first) and `entries/<key>.json` (the signed index, written last: an entry is visible only once
everything it names is there). Readers verify the signature against their trusted keys and every
byte against the index before anything reaches the store.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipelines.core import errors
from pipelines.core.errors import BadInput, PipelineError
from pipelines.core.s3 import (
    S3_CLIENT_OPTIONS,
    chain_has_credentials,
    client_config,
    make_client,
    s3_errors,
)
from pipelines.core.signing.namedkeys import PublicKey, SigningKey
from pipelines.engine.remote.entries import (
    MAX_INDEX_BYTES,
    EntryFile,
    EntryRefused,
    check_entry,
    make_entry,
    output_files,
)

if TYPE_CHECKING:
    from types_boto3_s3 import S3Client
    from types_boto3_s3.type_defs import CompletedPartTypeDef

CHUNK = 1 << 20
# Files above one part go up in parts of this size (a part is held in memory while it is sent).
PART = 64 << 20
WORKERS = 8
CLIENT_CONFIG: dict[str, Any] = {**S3_CLIENT_OPTIONS, "read_timeout": 60}


def parse_url(url: str) -> tuple[str, str]:
    """(bucket, prefix) of s3://BUCKET/PREFIX."""
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    if not url.startswith("s3://") or not bucket or not prefix.strip("/"):
        raise BadInput(f"environment SPARKFORGE_REMOTE_CACHE={url!r}: expected s3://BUCKET/PREFIX")
    return bucket, prefix.strip("/")


class CacheUnreachable(errors.Unreachable):
    """The cache cannot be reached at all (no endpoint, no credentials): not asked again."""


def missing(err: Exception) -> bool:
    """True when an S3 error says the object is not there."""
    code = getattr(err, "response", {}).get("Error", {}).get("Code")
    return code in ("404", "NoSuchKey", "NotFound")


@dataclass
class RemoteCache:
    """The engine's remote backend (has, publish, restore) for store-backed steps.

    Writes only with a signing key and not read-only; reads only entries a trusted key signed.
    """

    url: str
    trusted: dict[str, PublicKey]
    signer: SigningKey | None = field(default=None, repr=False)
    readonly: bool = False

    def __post_init__(self) -> None:
        self.bucket, self.prefix = parse_url(self.url)
        self.name = f"remote cache {self.url}"
        self.down: CacheUnreachable | None = None  # once unreachable, no step asks again

    @property
    def writable(self) -> bool:
        """True when this run may upload: it holds a signing key and is not read-only."""
        return self.signer is not None and not self.readonly

    @cached_property
    def client(self) -> S3Client:
        """A boto3 S3 client from the standard AWS chain (made on first use)."""
        import botocore

        options = dict(CLIENT_CONFIG)
        if not chain_has_credentials():
            if self.writable:
                raise CacheUnreachable(
                    "no S3 credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY,"
                    " or AWS_PROFILE"
                )
            # A read-only run without credentials (a fork's pull request): anonymous reads.
            options["signature_version"] = botocore.UNSIGNED
        config = client_config(max_pool_connections=WORKERS * 2, **options)
        client: S3Client = make_client(config)
        return client

    def entry_key(self, key: str) -> str:
        """The object key of a step key's signed index."""
        return f"{self.prefix}/entries/{key}.json"

    def object_key(self, sha256: str) -> str:
        """The object key of file bytes by their sha256."""
        return f"{self.prefix}/objects/sha256/{sha256}"

    def has(self, key: str) -> bool:
        """True when an index for key is there (not yet verified: restore does that)."""
        import botocore.exceptions

        with s3_errors(self.name, CacheUnreachable):
            try:
                self.client.head_object(Bucket=self.bucket, Key=self.entry_key(key))
            except botocore.exceptions.ClientError as err:
                if missing(err):
                    return False
                raise
        return True

    def restore(self, key: str, out: Path) -> dict[str, Any] | None:
        """Fill the empty folder out with key's verified output; its record, or None when absent.

        Raises EntryRefused (one line) for an entry that must not be used.
        """
        import botocore.exceptions

        if self.down is not None:
            raise self.down
        try:
            with s3_errors("S3 read", CacheUnreachable):
                client = self.client
                try:
                    got = client.get_object(Bucket=self.bucket, Key=self.entry_key(key))
                    size = got.get("ContentLength", 0)
                    if size > MAX_INDEX_BYTES:  # refused unread
                        raise EntryRefused(
                            f"index of {size} bytes, over the {MAX_INDEX_BYTES} allowed"
                        )
                    data = got["Body"].read(MAX_INDEX_BYTES + 1)  # whatever the header said
                except botocore.exceptions.ClientError as err:
                    if missing(err):
                        return None
                    raise
        except CacheUnreachable as err:
            self.down = err
            raise
        with s3_errors("S3 read", CacheUnreachable):
            entry = check_entry(data, key, self.trusted)
            try:
                for folder in entry.dirs:
                    (out / folder).mkdir(parents=True, exist_ok=True)
                with ThreadPoolExecutor(WORKERS) as pool:
                    list(pool.map(lambda f: self.download(f, out), entry.files))
            except OSError as err:  # a shape the checks above missed: built here all the same
                raise EntryRefused(f"restoring it: {type(err).__name__}: {err}") from None
        return entry.record

    def download(self, f: EntryFile, out: Path) -> None:
        """One file of an entry, hashed as it arrives; EntryRefused unless size and sha256 match."""
        import botocore.exceptions

        target = out / f.path
        target.parent.mkdir(parents=True, exist_ok=True)
        what = f"{f.path}: object sha256:{f.sha256[:16]}"
        try:
            body = self.client.get_object(Bucket=self.bucket, Key=self.object_key(f.sha256))["Body"]
        except botocore.exceptions.ClientError as err:
            if missing(err):
                raise EntryRefused(f"{what} missing (a partial entry)") from None
            raise
        digest = hashlib.sha256()
        size = 0
        with open(target, "wb") as dest:
            while chunk := body.read(CHUNK):
                size += len(chunk)
                if size > f.size:
                    break
                digest.update(chunk)
                dest.write(chunk)
        if size != f.size:
            raise EntryRefused(
                f"{what} has {size} bytes or more, expected {f.size} (truncated or grown)"
            )
        if digest.hexdigest() != f.sha256:
            raise EntryRefused(f"{what} has sha256 {digest.hexdigest()[:16]} (corrupted)")
        target.chmod(f.mode)

    def publish(self, key: str, work: Path, record: dict[str, Any]) -> None:
        """Upload work/out: the objects it lacks first, then the signed index (never read-only)."""
        if not self.writable:
            return
        if self.down is not None:
            raise self.down
        files, dirs = output_files(work / "out")
        try:
            with s3_errors("S3 write", CacheUnreachable), ThreadPoolExecutor(WORKERS) as pool:
                list(pool.map(lambda f: self.upload(f, work / "out" / f.path), files))
                entry = make_entry(key, record, files, dirs, self.signer)
                self.client.put_object(Bucket=self.bucket, Key=self.entry_key(key), Body=entry)
        except CacheUnreachable as err:
            self.down = err
            raise

    def upload(self, f: EntryFile, path: Path) -> None:
        """Put one file's bytes under its sha256 unless the bucket holds them already: an object
        of that size whose stored SHA-256 checksum is the one these bytes give (not its size
        alone: anyone who can write the bucket could have planted other bytes under the name)."""
        import botocore.exceptions

        name = self.object_key(f.sha256)
        # Read once more here, streaming: the bytes sent must be the bytes hashed.
        whole, parts = part_digests(path)
        if whole != f.sha256:
            raise PipelineError(f"{path}: changed while uploading")
        try:
            there = self.client.head_object(Bucket=self.bucket, Key=name, ChecksumMode="ENABLED")
            if there["ContentLength"] == f.size and there.get("ChecksumSHA256") == stored_checksum(
                whole, parts
            ):
                return
        except botocore.exceptions.ClientError as err:
            if not missing(err):
                raise
        # With checksums: the server refuses bytes that do not match them, and keeps them for
        # the next writer's check above.
        if len(parts) <= 1:
            with open(path, "rb") as body:
                self.client.put_object(
                    Bucket=self.bucket, Key=name, Body=body, ChecksumSHA256=b64(whole)
                )
            return
        self.upload_parts(name, path, parts)

    def upload_parts(self, name: str, path: Path, parts: list[str]) -> None:
        """A multipart upload of PART-sized pieces (S3 takes at most 5 GiB in one PUT, and a
        GB10 image layer can be more), each with its SHA-256; aborted if any part fails."""
        client = self.client
        upload = client.create_multipart_upload(
            Bucket=self.bucket, Key=name, ChecksumAlgorithm="SHA256"
        )["UploadId"]
        done: list[CompletedPartTypeDef] = []
        try:
            with open(path, "rb") as f:
                for number, digest in enumerate(parts, 1):
                    sent = client.upload_part(
                        Bucket=self.bucket,
                        Key=name,
                        UploadId=upload,
                        PartNumber=number,
                        Body=f.read(PART),
                        ChecksumSHA256=b64(digest),
                    )
                    done.append(
                        {"PartNumber": number, "ETag": sent["ETag"], "ChecksumSHA256": b64(digest)}
                    )
            client.complete_multipart_upload(
                Bucket=self.bucket, Key=name, UploadId=upload, MultipartUpload={"Parts": done}
            )
        except BaseException:
            with contextlib.suppress(Exception):
                client.abort_multipart_upload(Bucket=self.bucket, Key=name, UploadId=upload)
            raise


def b64(hex_digest: str) -> str:
    """A hex sha256 as S3's base64 checksum header."""
    return base64.b64encode(bytes.fromhex(hex_digest)).decode()


def part_digests(path: Path) -> tuple[str, list[str]]:
    """(sha256 of the file, sha256 of each PART-sized piece), in one pass."""
    whole, parts = hashlib.sha256(), []
    with open(path, "rb") as f:
        while piece := f.read(PART):
            whole.update(piece)
            parts.append(hashlib.sha256(piece).hexdigest())
    return whole.hexdigest(), parts


def stored_checksum(whole: str, parts: list[str]) -> str:
    """The ChecksumSHA256 S3 keeps for these bytes: the file's own after one PUT, and after a
    multipart upload the sha256 of the parts' digests with the count of parts."""
    if len(parts) <= 1:
        return b64(whole)
    joined = hashlib.sha256(b"".join(bytes.fromhex(p) for p in parts)).hexdigest()
    return f"{b64(joined)}-{len(parts)}"
