"""The model's lock and the TP3 config patch, on their own, without S3 (test_weights.py fetches)."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import pytest
from keying import read_chars

from pipelines.core.modellock import LockError, cache_key, load_lock, lock_path, require_locked
from pipelines.engine.statcache import StatCache
from pipelines.stages.weights.blobs import BlobStore
from pipelines.stages.weights.patch import PatchError, patch_tp3, patch_tp3_folder
from pipelines.stages.weights.stage import StageError, is_staged, stage
from pipelines.stages.weights.synthetic import model_names


def test_no_op_check_of_a_full_size_lock_reads_no_file_bytes(tmp_path):
    from noop import full_size_store, noop_check

    blobs, lock, folder = full_size_store(tmp_path)
    assert lock.size == 460 * 10**9
    before = read_chars()
    assert noop_check(blobs, lock, folder)
    assert read_chars() - before < 1 << 20


def test_the_no_op_benchmark_says_in_one_line_which_command_failed_and_why(tmp_path):
    from noop import one_run

    fails = [sys.executable, "-c", "import sys; print('first'); sys.exit('stack: not running')"]
    with pytest.raises(SystemExit) as stopped:
        one_run(fails, tmp_path)
    said = str(stopped.value)
    assert said.startswith(f"noop: `{Path(sys.executable).name} -c import sys;")
    assert said.endswith(f" in {tmp_path} exited 1: stack: not running") and "\n" not in said


def test_cache_key_follows_the_operator_convention():
    source = "s3://models/bot-lab-21/DeepSeek-V4.1-Flash-EXL3-3.5bpw-Pollard"
    assert cache_key(source) == "22fa141368a3262a"


def test_real_model_lock_lists_54_files_and_fetch_refuses_it_until_locked():
    path = lock_path("dsv41-flash-exl3")
    lock = load_lock(path)
    assert len(lock.files) == 54
    assert lock.source == "s3://models/bot-lab-21/DeepSeek-V4.1-Flash-EXL3-3.5bpw-Pollard"
    assert {e.name for e in lock.files} == set(model_names())
    with pytest.raises(LockError, match=r"files\['config.json'\].sha256: not locked yet"):
        require_locked(lock, path)


def test_malformed_lock_is_one_line_naming_file_and_field(tmp_path):
    path = tmp_path / "bad.lock.yaml"
    path.write_text("model: m\nsource: s3://b/p\nfiles:\n  - {name: a, size: -1}\n")
    with pytest.raises(LockError) as err:
        load_lock(path)
    assert str(err.value).startswith(f"{path}: field 'files.0.size'")
    assert "\n" not in str(err.value)


def test_tp3_patch_matches_the_domain_facts_and_refuses_other_shapes():
    config = {"text_config": {"num_attention_heads": 64, "o_groups": 8, "hidden_size": 7}}
    patched = patch_tp3(config)
    assert patched["text_config"]["num_attention_heads"] == 72
    assert patched["text_config"]["o_groups"] == 9
    original = {"num_attention_heads": 64, "o_groups": 8}
    assert patched["virtual_heads_from"] == original
    assert patched["text_config"]["virtual_heads_from"] == original
    assert patched["text_config"]["hidden_size"] == 7
    assert config["text_config"]["num_attention_heads"] == 64  # the input is left alone
    assert patch_tp3(patched) is patched  # idempotent
    for heads, groups in ((72, 9), (64, 4)):
        bad = {"text_config": {"num_attention_heads": heads, "o_groups": groups}}
        with pytest.raises(PatchError, match=rf"expected \(64, 8\).*got \({heads}, {groups}\)"):
            patch_tp3(bad)


def test_folder_patch_keeps_the_original_and_never_writes_through_a_hard_link(tmp_path):
    blob = tmp_path / "blob"
    blob.write_text(json.dumps({"text_config": {"num_attention_heads": 64, "o_groups": 8}}))
    original_bytes = blob.read_bytes()
    folder = tmp_path / "model"
    folder.mkdir()
    os.link(blob, folder / "config.json")
    assert patch_tp3_folder(folder) is True
    assert patch_tp3_folder(folder) is False
    assert blob.read_bytes() == original_bytes
    assert (folder / "config.json.orig-hf").read_bytes() == original_bytes
    assert json.loads((folder / "config.json").read_text())["text_config"]["o_groups"] == 9


@pytest.mark.parametrize("name", [".", "..", ".hidden", "a/b", "../x"])
def test_a_lock_naming_a_file_outside_or_hidden_is_one_line_naming_the_field(tmp_path, name):
    path = tmp_path / "bad.lock.yaml"
    path.write_text(f"model: m\nsource: s3://b/p\nfiles:\n  - {{name: '{name}', size: 1}}\n")
    with pytest.raises(LockError) as err:
        load_lock(path)
    assert str(err.value).startswith(f"{path}: field 'files.0.name'")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("name", "blob"),
    [("../../../outside", "real"), ("ABSOLUTE", "real"), (".config.json.staging", "real"),
     ("config.json", "../../../outside")],
    ids=["dot-dot", "absolute", "a staging name", "blob outside the store"],
)  # fmt: skip
def test_staging_refuses_a_plan_that_names_a_path_outside_the_folder(tmp_path, name, blob):
    # Plans also come from a patch's overrides (restorable from a cache) and ring plans: the
    # names are checked where they are used, not only where a lock was parsed.
    blobs = BlobStore(tmp_path / "weights", StatCache(tmp_path / "statcache.sqlite3"))
    real = hashlib.sha256(b"x").hexdigest()
    blobs.blob(real).parent.mkdir(parents=True, exist_ok=True)
    blobs.blob(real).write_bytes(b"x")
    (tmp_path / "outside").write_bytes(b"not a blob")
    folder = tmp_path / "weights" / "models" / "m"
    name = str(tmp_path / "outside") if name == "ABSOLUTE" else name
    plan = {name: real if blob == "real" else blob}
    for use in (stage, is_staged):
        with pytest.raises(StageError) as err:
            use(folder, plan, blobs)
        assert "in the staging plan" in str(err.value) or "expected 64 hex digits" in str(err.value)
    assert not folder.exists()
    assert (tmp_path / "outside").read_bytes() == b"not a blob"
