"""gc of the weights area and the .deb cache: partial downloads, staged model folders no root
reaches, cached .debs no Debian lock names; what a root reaches is never collected (the fast
lane: files on disk, flocks held as the fetcher and the stager hold them)."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from pathlib import Path

import pytest
import yaml

from pipelines.engine.gcplan import gc_plan
from pipelines.engine.store import Store
from pipelines.gc.checkout import Checkout
from pipelines.gc.collect import collect, remove_model_folder, remove_partial
from pipelines.gc.inventory import store_items
from pipelines.gc.roots import gather_roots
from pipelines.stages.weights.blobs import BlobStore

REPO = Path(__file__).resolve().parent.parent
LOCAL_SOURCE = yaml.safe_load((REPO / "pipelines/profiles/local.yaml").read_text())["model"][
    "source"
]
# The checkout's local profile stages its model here: the operator's cacheKey, written out.
LOCAL_KEY = hashlib.sha256(LOCAL_SOURCE.encode()).hexdigest()[:16]


def no_registry(host: str):
    raise AssertionError(f"no image here, no registry to ask ({host})")


def plan(store: Store, weights: Path) -> dict[str, tuple[bool, str]]:
    """item name -> (kept, why), as `doit gc` decides it."""
    items = store_items(store, weights)
    verdicts = gc_plan(items, gather_roots(store, weights, 3, [], no_registry))
    return {v.item.name: (v.alive, v.why) for v in verdicts}


def sweep(store: Store, weights: Path) -> None:
    """`doit gc --delete`'s plan and collection."""
    items = store_items(store, weights)
    collect(store, weights, gc_plan(items, gather_roots(store, weights, 3, [], no_registry)))


def held(path: Path):
    """An flock on path, held as another process would (its own open file)."""
    f = open(path, "w")  # noqa: SIM115 (closed by the caller)
    fcntl.flock(f, fcntl.LOCK_EX)
    return f


def test_a_killed_fetchs_partial_is_freed_and_one_in_progress_or_to_resume_is_kept(tmp_path):
    store, weights = Store(tmp_path / "store"), tmp_path / "weights"
    (weights / "partial").mkdir(parents=True)
    (weights / "blobs" / "sha256").mkdir(parents=True)
    locked = yaml.safe_load((REPO / "weights/dsv41-flash-synthetic.lock.yaml").read_text())
    resume = locked["files"][-1]["sha256"]  # a current lock names it, not stored yet
    killed, fetching, done = "1" * 64, "2" * 64, "3" * 64
    for sha in (killed, fetching, done, resume):
        (weights / "partial" / f"{sha}.part").write_bytes(b"x" * 100)
    (weights / "blobs" / "sha256" / done).write_bytes(b"whole")  # published since: no use
    writer = held(weights / "partial" / f"{fetching}.writer")
    try:
        verdicts = plan(store, weights)
        sweep(store, weights)
    finally:
        writer.close()

    assert verdicts[f"weights/partial/{killed[:16]}"] == (False, "no root reaches it")
    assert verdicts[f"weights/partial/{done[:16]}"] == (False, "no root reaches it")
    assert verdicts[f"weights/partial/{fetching[:16]}"] == (
        True,
        "a fetch in progress holds its writer lock",
    )
    kept, why = verdicts[f"weights/partial/{resume[:16]}"]
    assert kept and why.startswith("the next fetch resumes from it (dsv41-flash-synthetic")
    left = sorted(p.name for p in (weights / "partial").glob("*.part"))
    assert left == sorted([f"{fetching}.part", f"{resume}.part"])


@pytest.mark.timeout(20)
def test_a_partial_a_fetch_took_since_the_plan_is_not_deleted(tmp_path, capsys):
    weights = tmp_path / "weights"
    blobs = BlobStore(weights, Store(tmp_path / "store").statcache)
    part = blobs.partial_file("8" * 64)
    part.write_bytes(b"a prefix")
    writer = held(weights / "partial" / f"{'8' * 64}.writer")
    try:
        remove_partial(blobs, "8" * 64)
    finally:
        writer.close()

    assert part.read_bytes() == b"a prefix"
    said = capsys.readouterr().out
    assert f"gc: kept weights/partial/{'8' * 16}: a fetch took it since the plan" in said


def test_a_cached_deb_no_debian_lock_names_is_freed_and_a_locked_one_kept(tmp_path):
    store = Store(tmp_path / "store")
    locked = yaml.safe_load((REPO / "images/weights-stager/debian.lock.yaml").read_text())
    deb = locked["archs"]["amd64"][0]
    debs = store.root / "debs"
    debs.mkdir()
    (debs / deb["sha256"]).write_bytes(b"a locked .deb")
    (debs / ("4" * 64)).write_bytes(b"a .deb an older lock named")

    verdicts = plan(store, tmp_path / "weights")
    sweep(store, tmp_path / "weights")

    assert verdicts[f"debs/{'4' * 16}"] == (False, "no root reaches it")
    kept, why = verdicts[f"debs/{deb['sha256'][:16]}"]
    assert kept and why.startswith(f"weights-stager's Debian lock: {deb['name']} {deb['version']}")
    assert [p.name for p in debs.iterdir()] == [deb["sha256"]]


def staged(weights: Path, name: str, blob: bytes) -> Path:
    """A model folder staged as the weights stage stages one: a hard link to a blob."""
    sha = hashlib.sha256(blob).hexdigest()
    path = weights / "blobs" / "sha256" / sha
    if not path.exists():
        path.write_bytes(blob)
    folder = weights / "models" / name
    folder.mkdir()
    os.link(path, folder / "model.safetensors")
    return path


def test_a_model_folder_no_root_reaches_goes_with_its_blobs_and_kept_ones_stay(tmp_path):
    store, weights = Store(tmp_path / "store"), tmp_path / "weights"
    (weights / "blobs" / "sha256").mkdir(parents=True)
    (weights / "models").mkdir()
    orphan_blob = staged(weights, "5" * 16, b"a model no profile uses any more")
    profile_blob = staged(weights, LOCAL_KEY, b"the local profile's model")
    deployed_blob = staged(weights, "6" * 16, b"what the live deployment mounts")
    staged(weights, "a-folder-by-hand", b"what someone put here")
    records = store.root / "deployments" / "lab"
    records.mkdir(parents=True)
    mount = {"source": f"/srv/weights/models/{'6' * 16}", "target": "/models"}
    record = {
        "outcome": "deployed",
        "deployment": {"key": "d" * 64, "plans": [{"mounts": [mount]}]},
    }
    (records / "100.json").write_text(json.dumps(record))
    verdicts = plan(store, weights)
    sweep(store, weights)

    def model(name: str) -> tuple[bool, str]:
        return verdicts[f"weights/models/{name} (links to blobs, counted as blobs)"]

    assert model("5" * 16) == (False, "no root reaches it")
    assert verdicts[f"weights/blobs/{orphan_blob.name[:16]}"] == (False, "no root reaches it")
    assert model(LOCAL_KEY)[0] and "the model folder of profile local" in model(LOCAL_KEY)[1]
    assert model("6" * 16) == (True, f"named by the live deployment of lab ({'d' * 16})")
    assert model("a-folder-by-hand") == (
        True,
        "not named as a cacheKey: what made it is unknown",
    )
    # Collected: the orphan folder and the blob only it linked, nothing a root reaches.
    left = sorted(p.name for p in (weights / "models").iterdir() if p.is_dir())
    assert left == sorted([LOCAL_KEY, "6" * 16, "a-folder-by-hand"])
    assert not orphan_blob.exists()
    assert profile_blob.exists() and deployed_blob.exists()


@pytest.mark.timeout(20)
def test_a_model_folder_being_staged_is_kept_and_never_deleted_under_its_stager(tmp_path, capsys):
    store, weights = Store(tmp_path / "store"), tmp_path / "weights"
    (weights / "blobs" / "sha256").mkdir(parents=True)
    (weights / "models").mkdir()
    staged(weights, "7" * 16, b"a model being staged")
    folder = weights / "models" / ("7" * 16)
    stager = held(weights / "models" / f"{'7' * 16}.staging.lock")
    try:
        verdicts = plan(store, weights)
        # A plan made before the stager came: collect meets the stager's flock and keeps it.
        remove_model_folder(folder)
    finally:
        stager.close()

    name = f"weights/models/{'7' * 16} (links to blobs, counted as blobs)"
    assert verdicts[name] == (True, "being staged (its staging lock is held)")
    assert folder.is_dir() and (folder / "model.safetensors").is_file()
    said = capsys.readouterr().out
    assert f"gc: kept weights/models/{'7' * 16}: a stager took it since the plan" in said


def test_an_unreadable_profile_keeps_every_model_folder_and_says_which(tmp_path):
    store, weights = Store(tmp_path / "store"), tmp_path / "weights"
    (weights / "blobs" / "sha256").mkdir(parents=True)
    (weights / "models").mkdir()
    staged(weights, "9" * 16, b"a model only a lab's profile may name")
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    (profiles / "lab.yaml").write_text("name: lab\nmodel: [")
    items = store_items(store, weights)
    roots = gather_roots(store, weights, 3, [], no_registry, Checkout(profiles=(profiles,)))
    [verdict] = [v for v in gc_plan(items, roots) if v.item.kind == "model"]

    assert verdict.alive
    assert verdict.why.startswith("kept: profile unreadable: ")
    assert "lab.yaml" in verdict.why
