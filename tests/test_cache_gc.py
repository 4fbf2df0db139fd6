"""`python -m pipelines.engine.remote gc` against the stack's SeaweedFS: entries no root reaches and
older than D days go, objects no kept entry names go, a kept entry still restores."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from pipelines.core.signing.namedkeys import keygen
from pipelines.engine.remote import remote_cache
from pipelines.engine.remote.remote import RemoteCache

REPO = Path(__file__).resolve().parent.parent
BUCKET = "models"  # the stack's bucket; the module works under a prefix of its own
KEPT, DROPPED, OTHER = "1" * 64, "2" * 64, "3" * 64


def publish(cache: RemoteCache, key: str, files: dict[str, bytes], tmp_path: Path) -> None:
    """One entry of the cache, as a build's upload leaves it."""
    work = tmp_path / key
    (work / "out").mkdir(parents=True)
    for name, data in files.items():
        (work / "out" / name).write_bytes(data)
    cache.publish(key, work, {"key": key, "name": "test", "finished": 1.0})


@pytest.fixture
def filled(s3, stack_env, tmp_path):
    """A cache prefix with three entries (two share a file), an object no entry names, and a
    file that is not the cache's; a roots file naming the first entry's key."""
    prefix = f"cache-gc-test-{uuid.uuid4().hex[:8]}"
    keygen("cache-gc-test", tmp_path / "key")
    cache = remote_cache(f"s3://{BUCKET}/{prefix}", (tmp_path / "key").read_text(), (), False)
    assert cache is not None
    env = {**os.environ, **stack_env, "SPARKFORGE_REMOTE_CACHE": cache.url}
    old = dict(os.environ)
    os.environ.update(stack_env)
    try:
        publish(cache, KEPT, {"a.yaml": b"shared\n", "b.yaml": b"kept only\n"}, tmp_path)
        publish(cache, DROPPED, {"a.yaml": b"shared\n", "c.yaml": b"dropped only\n"}, tmp_path)
        publish(cache, OTHER, {"d.yaml": b"other\n"}, tmp_path)
    finally:
        os.environ.clear()
        os.environ.update(old)
    orphan = hashlib.sha256(b"orphan").hexdigest()
    s3.put_object(Bucket=BUCKET, Key=f"{prefix}/objects/sha256/{orphan}", Body=b"orphan")
    s3.put_object(Bucket=BUCKET, Key=f"{prefix}/notes.txt", Body=b"not the cache's")
    roots = tmp_path / "roots.json"
    roots.write_text(json.dumps({"steps": [KEPT]}))
    yield {"prefix": prefix, "env": env, "roots": roots, "cache": cache}
    for key in names(s3, prefix):
        s3.delete_object(Bucket=BUCKET, Key=key)


def names(s3, prefix: str) -> list[str]:
    """Every object name under prefix, relative to it."""
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=f"{prefix}/")
    return sorted(o["Key"][len(prefix) + 1 :] for p in pages for o in p.get("Contents", []))


def cache_gc(filled, *args: str) -> subprocess.CompletedProcess:
    """`python -m pipelines.engine.remote gc ARGS` on the filled prefix."""
    result = subprocess.run(
        [sys.executable, "-m", "pipelines.engine.remote", "gc", *args],
        cwd=REPO,
        env=filled["env"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    print(result.stdout + result.stderr)
    return result


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_cache_gc_frees_what_no_root_reaches_and_a_kept_entry_restores(
    filled, s3, stack_env, tmp_path
):
    before = names(s3, filled["prefix"])
    young = cache_gc(filled, "--roots", str(filled["roots"]))  # default 30 days: all young
    assert young.returncode == 0, young.stderr
    assert "total: would free 0 B" in young.stdout

    dry = cache_gc(filled, "--days", "0", "--roots", str(filled["roots"]))

    assert dry.returncode == 0, dry.stderr
    assert "dry run, nothing deleted" in dry.stdout
    assert f"entries/{KEPT[:16]}" in dry.stdout and f"a root of {filled['roots']}" in dry.stdout
    assert names(s3, filled["prefix"]) == before

    real = cache_gc(filled, "--days", "0", "--roots", str(filled["roots"]), "--delete")

    assert real.returncode == 0, real.stderr
    assert names(s3, filled["prefix"]) == sorted(
        [
            f"entries/{KEPT}.json",
            "notes.txt",
            f"objects/sha256/{sha(b'kept only' + bytes([10]))}",
            f"objects/sha256/{sha(b'shared' + bytes([10]))}",
        ]
    )
    old = dict(os.environ)
    os.environ.update(stack_env)
    try:
        (tmp_path / "restored").mkdir()
        record = filled["cache"].restore(KEPT, tmp_path / "restored")
    finally:
        os.environ.clear()
        os.environ.update(old)
    assert record is not None and record["key"] == KEPT
    assert (tmp_path / "restored" / "a.yaml").read_bytes() == b"shared\n"


@pytest.mark.parametrize(
    ("content", "expected"),
    [('{"steps": ["../x"]}', "field 'steps'"), ("{", "")],
    ids=["not-keys", "truncated"],
)
def test_a_bad_roots_file_is_one_line_and_exit_2(filled, s3, content, expected):
    before = names(s3, filled["prefix"])
    filled["roots"].write_text(content)

    result = cache_gc(filled, "--days", "0", "--roots", str(filled["roots"]), "--delete")

    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and str(filled["roots"]) in lines[0]
    assert expected in lines[0]
    assert names(s3, filled["prefix"]) == before
