"""A small synthetic stand-in for the model: the same 54 names and shape, deterministic bytes."""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, cast

from pipelines.stages.weights.s3 import S3Url

if TYPE_CHECKING:
    from types_boto3_s3 import S3Client

MiB = 1 << 20
SHARDS = 48
ENGRAM_SHARDS = (47, 48)  # the two Engram tables, much bigger than the rest
SMALL_FILES = (
    "config.json",
    "quantization_config.json",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
)
UPLOAD_PART = 8 * MiB  # fixed, so multipart ETags are the same on every upload


@dataclass(frozen=True)
class SyntheticShape:
    """Sizes of the synthetic model: 46 ordinary shards and two big Engram shards."""

    shard_bytes: int = 1 * MiB
    engram_bytes: int = 24 * MiB
    seed: str = "sparkforge-synthetic-v1"


def shard_name(n: int) -> str:
    """The file name of shard n (1-based)."""
    return f"model-{n:05d}-of-{SHARDS:05d}.safetensors"


def model_names() -> list[str]:
    """The 54 file names of the model, in lock order."""
    return [*SMALL_FILES, "MD5SUMS.body", *(shard_name(n) for n in range(1, SHARDS + 1))]


def shard_size(shape: SyntheticShape, n: int) -> int:
    """Payload bytes of shard n."""
    return shape.engram_bytes if n in ENGRAM_SHARDS else shape.shard_bytes


def config_json() -> bytes:
    """A config.json with the attention shape of DeepSeek-V4.1-Flash (64 heads, 8 o_groups)."""
    config = {
        "architectures": ["DeepseekV41ForCausalLM"],
        "model_type": "deepseek_v41",
        "quantization_config": {"quant_method": "exl3", "bits": 3.5},
        "text_config": {
            "hidden_size": 256,
            "num_attention_heads": 64,
            "o_groups": 8,
            "num_hidden_layers": 2,
            "vocab_size": 512,
        },
        "sparkforge_synthetic": True,
    }
    return (json.dumps(config, indent=2) + "\n").encode()


def small_files(shape: SyntheticShape) -> dict[str, bytes]:
    """The five small JSON files."""
    weight_map = {f"layers.{n}.weight": shard_name(n) for n in range(1, SHARDS + 1)}
    vocab = {f"tok{i}": i for i in range(512)}
    return {
        "config.json": config_json(),
        "quantization_config.json": json.dumps({"quant_method": "exl3", "bits": 3.5}).encode(),
        "model.safetensors.index.json": json.dumps({"weight_map": weight_map}, indent=2).encode(),
        "tokenizer.json": json.dumps({"version": "1.0", "model": {"vocab": vocab}}).encode(),
        "tokenizer_config.json": json.dumps({"model_max_length": 131072}).encode(),
    }


def shard_chunks(shape: SyntheticShape, n: int, chunk: int = 4 * MiB) -> Iterator[bytes]:
    """A valid safetensors file (one U8 tensor) with pseudo-random payload, in chunks."""
    size = shard_size(shape, n)
    header = json.dumps(
        {f"layers.{n}.weight": {"dtype": "U8", "shape": [size], "data_offsets": [0, size]}}
    ).encode()
    header += b" " * (-len(header) % 8)
    yield struct.pack("<Q", len(header)) + header
    # One random pool per shard, each chunk stamped with its index: unique bytes, made fast.
    # No longer than the shard: SHAKE's shorter output is a prefix of its longer one, so the
    # bytes are the same, and a 1 MiB shard no longer draws 4 MiB.
    pool = hashlib.shake_256(f"{shape.seed}/{n}".encode()).digest(min(chunk, size))
    done = 0
    index = 0
    while done < size:
        stamp = hashlib.sha256(f"{shape.seed}/{n}/{index}".encode()).digest()
        block = (stamp + pool[len(stamp) :])[: size - done]
        yield block
        done += len(block)
        index += 1


def md5sums(files: dict[str, bytes], shape: SyntheticShape) -> bytes:
    """MD5SUMS.body: upstream's second, independent check of every other file."""
    lines = [f"{hashlib.md5(data).hexdigest()}  {name}" for name, data in files.items()]
    for n in range(1, SHARDS + 1):
        md5 = hashlib.md5()
        for block in shard_chunks(shape, n):
            md5.update(block)
        lines.append(f"{md5.hexdigest()}  {shard_name(n)}")
    return ("\n".join(lines) + "\n").encode()


class ChunkReader:
    """A file-like reader over an iterator of byte chunks (for boto3's upload_fileobj)."""

    def __init__(self, chunks: Iterator[bytes]):
        self._chunks = chunks
        self._buf = b""
        self.count = 0

    def read(self, size: int = -1) -> bytes:
        while size < 0 or len(self._buf) < size:
            nxt = next(self._chunks, None)
            if nxt is None:
                break
            self._buf += nxt
        if size < 0:
            out, self._buf = self._buf, b""
        else:
            out, self._buf = self._buf[:size], self._buf[size:]
        self.count += len(out)
        return out


def upload_synthetic(client: S3Client, source: str, shape: SyntheticShape) -> int:
    """Write the synthetic model under source in the bucket; returns the bytes uploaded."""
    from boto3.s3.transfer import TransferConfig  # loaded only when uploading

    url = S3Url.parse(source)
    config = TransferConfig(
        multipart_threshold=UPLOAD_PART, multipart_chunksize=UPLOAD_PART, max_concurrency=8
    )
    files = small_files(shape)
    files["MD5SUMS.body"] = md5sums(files, shape)
    total = 0
    for name, data in files.items():
        client.put_object(Bucket=url.bucket, Key=url.key(name), Body=data)
        total += len(data)
    for n in range(1, SHARDS + 1):
        reader = ChunkReader(shard_chunks(shape, n))
        # boto3 reads a file object only through read(), which ChunkReader gives.
        body = cast(IO[bytes], reader)
        client.upload_fileobj(body, url.bucket, url.key(shard_name(n)), Config=config)
        total += reader.count
    return total
