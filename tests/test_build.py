"""`doit build profile=local` end to end against the local stack, as a user runs it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from support.doit import run_doit

from pipelines.core.modellock import cache_key, load_lock, lock_path
from pipelines.engine.statcache import StatCache
from pipelines.stages.weights.blobs import BlobStore

REPO = Path(__file__).resolve().parent.parent
BIG = "model-00048-of-00048.safetensors"


@pytest.fixture
def doit(stack, tmp_path):
    """Run doit in the checkout with a private store; returns the finished process."""
    env = {**os.environ, "SPARKFORGE_STORE": str(tmp_path / "store")}

    def run(*args: str) -> subprocess.CompletedProcess:
        return run_doit(*args, env=env, timeout=300)

    return run


def ran(output: str) -> set[str]:
    """Names of the tasks doit executed (lines '.  name'), not those up to date ('-- name')."""
    return {line[3:].strip() for line in output.splitlines() if line.startswith(".  ")}


def test_build_fetches_patches_and_stages_then_does_nothing(doit, tmp_path):
    first = doit("build", "profile=local")
    assert first.returncode == 0, first.stderr + first.stdout
    assert {"fetch_weights", "patch_config", "stage_weights"} <= ran(first.stdout)

    lock = load_lock(lock_path("dsv41-flash-synthetic"))
    folder = tmp_path / "store" / "weights" / "models" / cache_key(lock.source)
    assert (folder / "config.json.orig-hf").read_bytes() != (folder / "config.json").read_bytes()
    assert '"num_attention_heads": 72' in (folder / "config.json").read_text()
    assert len(list(folder.iterdir())) == 55

    second = doit("build", "profile=local")
    assert second.returncode == 0, second.stderr
    assert ran(second.stdout) == set()


def test_verify_names_a_corrupted_blob_and_the_next_build_refetches_only_it(doit, tmp_path):
    assert doit("build", "profile=local").returncode == 0
    lock = load_lock(lock_path("dsv41-flash-synthetic"))
    blobs = BlobStore(tmp_path / "store" / "weights", StatCache(tmp_path / "x.sqlite3"))
    blob = blobs.blob(lock.entry(BIG).sha256)
    blob.chmod(0o644)
    with blob.open("r+b") as f:
        f.seek(1000)
        f.write(b"\x00\x01\x02")

    verify = doit("verify_weights", "profile=local")
    assert verify.returncode != 0
    assert f"{BIG}: expected {lock.entry(BIG).sha256}, got " in verify.stdout + verify.stderr

    again = doit("build", "profile=local")
    assert again.returncode == 0, again.stderr
    assert "1 fetched, 53 already stored" in again.stdout
    assert doit("verify_weights", "profile=local").returncode == 0
