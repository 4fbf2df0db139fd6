"""How every S3 client of the pipeline is configured (the model bucket, the remote cache)."""

from typing import Any

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
