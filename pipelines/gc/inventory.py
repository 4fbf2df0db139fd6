"""What the store holds, as gc's items: step outputs (normalized layers among them), builders'
leftovers, model blobs, staged model folders, partial downloads, cached .debs and bench runs,
each with its bytes and the refs a root reaches it by."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from pipelines.core.errors import BadInput
from pipelines.core.files import MiB, read_capped
from pipelines.engine.gcplan import Item
from pipelines.engine.store import CorruptStepRecord, Store, read_record

HEX64 = re.compile(r"[0-9a-f]{64}")
# results.json holds every request's chunk timings: some MiB; past this it is not the bench's.
RESULTS_MAX_BYTES = 64 * MiB


class Unreadable(BadInput):
    """A file gc reads (a bench run's results.json, a layer's layer.json) that cannot be read."""


def tree_size(path: Path) -> int:
    """The bytes of the files under path (a file's own size), links not followed."""
    if not path.is_dir() or path.is_symlink():
        return path.lstat().st_size
    total = 0
    for dirpath, _, filenames in os.walk(path):
        total += sum(os.lstat(os.path.join(dirpath, n)).st_size for n in filenames)
    return total


def step_items(store: Store) -> list[Item]:
    """Each complete step output, reached as `step:<key>`; a render's also as the deployment
    its documents make (`deployment:<digest of the documents>`, what deploy keys it by)."""
    items = []
    for folder in sorted((store.root / "steps").iterdir()):
        if not HEX64.fullmatch(folder.name) or not (folder / "step.json").is_file():
            continue
        refs = [f"step:{folder.name}"]
        try:
            name = str(read_record(folder / "step.json").get("name", "?"))
        except CorruptStepRecord:
            name = "unreadable record"
        if name == "render" and (folder / "out").is_dir():
            digest, _ = store.statcache.tree_listing(folder / "out")
            refs.append(f"deployment:{digest}")
        kind = "step"
        if name == "layer":  # a normalized layer stays while a kept image names its blob
            kind, blob = "layer", layer_blob(folder / "out" / "layer.json")
            refs += [f"layer:{blob}"] if blob else []
        items.append(
            Item(kind, f"steps/{folder.name[:16]} ({name})", tree_size(folder), tuple(refs))
        )
    return items


def layer_blob(index: Path) -> str | None:
    """The blob digest a layer output's layer.json names, or None (unreadable: no root then
    reaches it by its blob, and the layer cache makes it again when an image needs it)."""
    try:
        digest = json.loads(read_capped(index, MiB, Unreadable))["digest"]
    except (OSError, Unreadable, ValueError, KeyError, TypeError, RecursionError):
        return None
    return (
        digest if isinstance(digest, str) and re.fullmatch(r"sha256:[0-9a-f]{64}", digest) else None
    )


def tmp_items(store: Store) -> list[Item]:
    """Builders' temp folders (`<key>.<pid>.<ns>`), reached as `building:<key>`."""
    return [
        Item("tmp", f"tmp/{p.name}", tree_size(p), (f"building:{p.name.split('.')[0]}",))
        for p in sorted((store.root / "tmp").iterdir())
    ]


def legacy_items(store: Store) -> list[Item]:
    """The layer cache's folder of before layers became step outputs: nothing reads it now."""
    folder = store.root / "layers"
    if not folder.is_dir():
        return []
    return [Item("tmp", "layers (the layer cache's old folder)", tree_size(folder), ())]


def blobs_by_digest(folder: Path, kind: str, shown: str, ref: str) -> list[Item]:
    """The files named by a sha256 in folder, as items called shown/<hex> reached as ref<hex>."""
    if not folder.is_dir():
        return []
    return [
        Item(kind, f"{shown}/{p.name[:16]}", p.lstat().st_size, (f"{ref}{p.name}",))
        for p in sorted(folder.iterdir())
        if HEX64.fullmatch(p.name)
    ]


def model_folders(weights: Path) -> list[Path]:
    """The staged model folders (`models/<cacheKey>`; a stager's hidden temp names aside)."""
    models = weights / "models"
    return sorted(
        p
        for p in (models.iterdir() if models.is_dir() else ())
        if p.is_dir() and not p.is_symlink() and not p.name.startswith(".")
    )


def model_items(weights: Path) -> list[Item]:
    """Staged model folders (`models/<cacheKey>`), reached as `model:<cacheKey>`. Their files
    are links to blobs: only bytes no blob holds count here (the blobs count as blobs, freed
    once no kept folder links them)."""
    items = []
    for folder in model_folders(weights):
        own = 0
        for dirpath, _, filenames in os.walk(folder):
            for name in filenames:
                st = os.lstat(os.path.join(dirpath, name))
                own += st.st_size if st.st_nlink == 1 else 0
        shown = f"weights/models/{folder.name} (links to blobs, counted as blobs)"
        items.append(Item("model", shown, own, (f"model:{folder.name}",)))
    return items


def partial_items(weights: Path) -> list[Item]:
    """Partial downloads (`partial/<sha256>.part`), reached as `partial:<sha256>`."""
    parts = sorted((weights / "partial").glob("*.part"))
    shas = [p.name.removesuffix(".part") for p in parts]
    return [
        Item("partial", f"weights/partial/{p.name[:16]}", p.lstat().st_size, (f"partial:{sha}",))
        for p, sha in zip(parts, shas, strict=True)
        if HEX64.fullmatch(sha)
    ]


def bench_items(store: Store) -> list[Item]:
    """Bench runs (`bench/<profile>/<time>/`), reached as `bench:<profile>/<time>` and as the
    deployment they measured (`deployment:<manifests_key>` of their results' provenance)."""
    bench = store.root / "bench"
    items = []
    for run in sorted(bench.glob("*/*")) if bench.is_dir() else ():
        if not run.is_dir():
            continue
        refs = [f"bench:{run.parent.name}/{run.name}"]
        key = measured_deployment(run / "results.json")
        if key:
            refs.append(f"deployment:{key}")
        items.append(
            Item("bench", f"bench/{run.parent.name}/{run.name}", tree_size(run), tuple(refs))
        )
    return items


def measured_deployment(results: Path) -> str | None:
    """The deployment key a run's results name, or None (absent, unreadable or malformed: the
    run is then reached only as the newest of its profile)."""
    try:
        data = json.loads(read_capped(results, RESULTS_MAX_BYTES, Unreadable))
        key = data["provenance"]["manifests_key"]
    except (OSError, Unreadable, ValueError, KeyError, TypeError, RecursionError):
        return None
    return key if isinstance(key, str) and HEX64.fullmatch(key) else None


def store_items(store: Store, weights: Path) -> list[Item]:
    """Everything gc may collect in the store and the weights folder."""
    return [
        *step_items(store),
        *tmp_items(store),
        *legacy_items(store),
        *model_items(weights),
        *blobs_by_digest(weights / "blobs" / "sha256", "blob", "weights/blobs", "blob:"),
        *partial_items(weights),
        *blobs_by_digest(store.root / "debs", "deb", "debs", "deb:"),
        *bench_items(store),
    ]
