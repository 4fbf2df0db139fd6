"""gc's plan and its inputs read from disk: pure decisions, hostile files named in one line
(the fast lane: no service)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipelines.core.errors import BadInput
from pipelines.core.settings import read_settings
from pipelines.engine.gcplan import Item, Roots, freed_bytes, gc_plan, kept_step_keys, report
from pipelines.engine.store import Store
from pipelines.gc.builds import last_builds, log_build
from pipelines.gc.inventory import measured_deployment, store_items
from pipelines.gc.roots import gather_roots, manifest_layers
from pipelines.gc.tags import DAY_S, first_seen, read_ledger, tag_items, tag_roots
from pipelines.stages.deploy.records import CorruptDeploymentRecord

REPO = Path(__file__).resolve().parent.parent
STEP = Item("step", "steps/aaaa (render)", 100, ("step:aa", "deployment:dd"))
OLD = Item("step", "steps/bbbb (render)", 40, ("step:bb",))
LAYER = Item("layer", "layers/blobs/cccc", 7, ("layer:sha256:cc",))


def test_an_item_a_root_reaches_is_kept_with_its_reason_and_the_rest_is_freed():
    roots = Roots({"deployment:dd": "the live deployment of local"}, {})

    verdicts = gc_plan([OLD, LAYER, STEP], roots)

    assert [(v.item.name, v.alive, v.why) for v in verdicts] == [
        ("steps/aaaa (render)", True, "the live deployment of local"),
        ("steps/bbbb (render)", False, "no root reaches it"),
        ("layers/blobs/cccc", False, "no root reaches it"),
    ]
    assert freed_bytes(verdicts) == 47
    assert report(verdicts, deleting=False)[-1] == "total: would free 47 B"


def test_a_kind_whose_roots_are_unknown_is_kept_whole():
    roots = Roots({}, {"layer": "the layers of an image unknown (registry unreachable)"})

    verdicts = gc_plan([LAYER, OLD], roots)

    assert [(v.item.kind, v.alive) for v in verdicts] == [("step", False), ("layer", True)]
    assert "registry unreachable" in verdicts[1].why


def test_the_build_log_keeps_the_newest_n_per_profile_and_names_a_bad_entry(tmp_path, capsys):
    for n in range(3):
        log_build(tmp_path, "local", {"render": f"{n:064x}"}, [])
    (tmp_path / "local" / f"{10**20}.json").write_text('{"profile": "local", "steps": 3}')

    builds = last_builds(tmp_path, 2)

    assert [b["steps"]["render"][-1] for b in builds["local"]] == ["2", "1"]
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{10**20}.json" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "content",
    ["", "{", "[]", json.dumps({"provenance": {"manifests_key": "../x"}}), "[" * 10000],
    ids=["empty", "truncated", "not-an-object", "not-a-key", "deep"],
)
def test_a_bench_result_that_cannot_be_read_names_no_deployment(tmp_path, content):
    path = tmp_path / "results.json"
    path.write_text(content)

    assert measured_deployment(path) is None


def test_a_manifest_that_is_not_one_names_no_layer():
    good = {
        "config": {"digest": "sha256:" + "1" * 64},
        "layers": [{"digest": "sha256:" + "2" * 64}],
    }
    assert manifest_layers(json.dumps(good).encode()) == [
        "sha256:" + "1" * 64,
        "sha256:" + "2" * 64,
    ]
    bad = {"config": {"digest": "sha256:../x"}, "layers": []}
    assert manifest_layers(json.dumps(bad).encode()) is None
    assert manifest_layers(b"not json") is None


@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5"])
def test_a_bad_keep_builds_setting_is_one_line(value):
    with pytest.raises(BadInput, match=r"SPARKFORGE_GC_KEEP_BUILDS=.*whole number"):
        read_settings({"SPARKFORGE_GC_KEEP_BUILDS": value})


def no_registry(host: str):
    raise AssertionError(f"no image here, no registry to ask ({host})")


def test_a_step_in_progress_keeps_its_temp_folder_and_a_killed_builders_is_freed(tmp_path):
    store = Store(tmp_path / "store")
    (store.root / "tmp" / f"{'1' * 64}.123.456").mkdir()  # a killed builder's
    (store.root / "tmp" / f"{'2' * 64}.124.457").mkdir()

    with store.lock("2" * 64):  # a builder at work
        items = store_items(store, tmp_path / "weights")
        building = [i.refs[0].split(":", 1)[1] for i in items]
        verdicts = gc_plan(items, gather_roots(store, tmp_path / "w", 3, building, no_registry))

    assert [(v.item.name[:8], v.alive, v.why) for v in verdicts] == [
        ("tmp/1111", False, "no root reaches it"),
        ("tmp/2222", True, "a step in progress (its build lock is held)"),
    ]


def test_an_unreadable_deployment_record_newer_than_the_live_one_refuses_gc(tmp_path):
    store = Store(tmp_path / "store")
    folder = store.root / "deployments" / "local"
    folder.mkdir(parents=True)
    good = {"outcome": "deployed", "deployment": {"key": "a" * 64}}
    (folder / "100.json").write_text(json.dumps(good))
    (folder / "200.json").write_text('{"outcome": "depl')

    with pytest.raises(
        CorruptDeploymentRecord, match=r"gc refused: .*200\.json.*what is live is not known"
    ):
        gather_roots(store, tmp_path / "weights", 3, [], no_registry)


def test_the_roots_file_names_kept_steps_and_the_steps_roots_name_but_not_other_kinds():
    blob = Item("blob", "weights/blobs/eeee", 5, ("blob:" + "e" * 64,))
    roots = Roots({"deployment:dd": "live", "step:ff": "build 1", "blob:" + "e" * 64: "staged"}, {})

    keys = kept_step_keys(gc_plan([STEP, OLD, blob], roots), roots)

    assert keys == ["aa", "ff"]


LIVE, OLD_IMAGE = "sha256:" + "a" * 64, "sha256:" + "b" * 64


def test_an_image_goes_with_all_its_tags_only_when_none_may_stay():
    tagged = {
        "candidate-1": OLD_IMAGE,
        "key-1": OLD_IMAGE,
        "key-2": LIVE,
        "stable": LIVE,
        "candidate-new": "sha256:" + "c" * 64,
    }
    seen = {"r:candidate-1": 0.0, "r:key-1": 0.0, "r:key-2": 0.0, "r:candidate-new": 9 * DAY_S}
    reach = tag_roots("r", tagged, {LIVE: "the live deployment"}, seen, 10 * DAY_S, 3)

    verdicts = gc_plan(tag_items("r", tagged), Roots(reach, {}))

    assert [(v.item.name, v.alive) for v in verdicts] == [
        ("r:candidate-1", False),
        ("r:candidate-new", True),
        ("r:key-1", False),
        ("r:key-2", True),
    ]
    assert "first seen by gc 1.0 days ago (< 3)" in verdicts[1].why
    assert verdicts[3].why == "the live deployment; also tagged stable"


def test_the_ledger_keeps_first_sightings_and_forgets_tags_that_went():
    old = {"r:key-1": 5.0, "r:key-gone": 1.0, "other:key-1": 2.0}

    ledger = first_seen(old, "r", ["key-1", "key-new", "stable"], 100.0)

    assert ledger == {"r:key-1": 5.0, "r:key-new": 100.0, "other:key-1": 2.0}


@pytest.mark.parametrize("content", ["{", '{"r:key-1": "soon"}', "[]"])
def test_a_ledger_that_cannot_be_read_is_one_line(tmp_path, content):
    path = tmp_path / "tags-seen.json"
    path.write_text(content)

    with pytest.raises(BadInput, match=str(path)):
        read_ledger(path)


@pytest.mark.parametrize("value", ["-1", "a week", "1e3"])
def test_a_bad_tag_days_setting_is_one_line(value):
    with pytest.raises(BadInput, match=r"SPARKFORGE_GC_TAG_DAYS=.*number from 0 to 36,500"):
        read_settings({"SPARKFORGE_GC_TAG_DAYS": value})


ALONE = """
import sys
from pathlib import Path
from pipelines.engine.store import Store
store = Store(Path(sys.argv[1]))
with store.alone("gc"):
    print("alone", flush=True)
    sys.stdin.readline()
"""
USER = """
import sys, time
from pathlib import Path
from pipelines.engine.store import Store
Store(Path(sys.argv[1]))
print("opened", flush=True)
"""


def test_a_run_that_opens_the_store_while_gc_has_it_alone_waits(tmp_path):
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    run = [sys.executable, "-c"]
    gc = subprocess.Popen(
        [*run, ALONE, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert gc.stdout.readline() == "alone\n"
        user = subprocess.Popen(
            [*run, USER, str(tmp_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        said = user.stderr.readline()  # "" at once if it does not wait
        assert said == f"store: waiting for the gc of {tmp_path} to finish\n"
        assert user.poll() is None
        gc.stdin.write("done\n")
        gc.stdin.flush()
        out, _ = user.communicate(timeout=10)
    finally:
        gc.kill()
    assert out == "opened\n"


def test_a_normalized_layer_stays_while_a_kept_image_names_its_blob(tmp_path):
    import io
    import tarfile

    from pipelines.gc.collect import collect
    from pipelines.stages.images.layer_cache import LayerCache

    store = Store(tmp_path / "store")
    tar_path = tmp_path / "layer.tar"
    with tarfile.open(tar_path, "w") as tar:
        tar.addfile(tarfile.TarInfo("etc/empty"), io.BytesIO(b""))
    blob, _, _ = LayerCache(store).normalize(tar_path, 0)
    (store.root / "layers" / "blobs").mkdir(parents=True)  # the layer cache's old folder
    items = store_items(store, tmp_path / "weights")
    (layer,) = [i for i in items if i.kind == "layer"]
    assert f"layer:{blob.digest}" in layer.refs

    kept = gc_plan(items, Roots({f"layer:{blob.digest}": "a layer of local-sim@sha256:..."}, {}))
    assert [(v.item.kind, v.alive) for v in kept] == [("tmp", False), ("layer", True)]
    assert kept_step_keys(kept, Roots({}, {})) == [layer.refs[0].removeprefix("step:")]
    unknown = gc_plan(items, Roots({}, {"layer": "the layers of an image unknown"}))
    assert [v.alive for v in unknown if v.item.kind == "layer"] == [True]

    collect(store, tmp_path / "weights", gc_plan(items, Roots({}, {})))
    assert not (store.root / "layers").exists()
    assert [p.name for p in (store.root / "steps").iterdir()] == []
