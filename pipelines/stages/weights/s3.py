"""S3-compatible object stores: clients from the standard AWS chain, and s3:// URLs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipelines.core.errors import BadInput
from pipelines.core.s3 import MODEL_S3_OPTIONS, chain_has_credentials, client_config, make_client

if TYPE_CHECKING:
    from types_boto3_s3 import S3Client


@dataclass(frozen=True)
class S3Url:
    """A bucket and a key prefix."""

    bucket: str
    prefix: str

    @classmethod
    def parse(cls, url: str) -> S3Url:
        """Split s3://bucket/prefix (the prefix without a trailing slash)."""
        if not url.startswith("s3://") or "/" not in url[5:]:
            raise BadInput(f"{url!r}: expected s3://BUCKET/PREFIX")
        bucket, _, prefix = url[5:].partition("/")
        return cls(bucket, prefix.rstrip("/"))

    def key(self, name: str) -> str:
        """The object key of a file name under the prefix."""
        return f"{self.prefix}/{name}"


def s3_client(pool: int = 32) -> S3Client:
    """A boto3 S3 client from the standard chain (env, AWS_PROFILE, config files)."""
    if not chain_has_credentials():
        raise BadInput(
            "no S3 credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE"
            " (for the local profile, `scripts/stack up` provides them)"
        )
    config = client_config(max_pool_connections=pool, **MODEL_S3_OPTIONS)
    client: S3Client = make_client(config)
    return client
