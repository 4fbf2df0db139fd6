"""gc's roots, learnt at the edge: deployment records, the build log, `:stable` and
`stable-prev`, builds in progress, the checkout's profiles and locks, model folders staged or
being staged, fetches in progress, the newest bench run of a profile."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipelines.core.errors import PipelineError
from pipelines.core.files import flock_held
from pipelines.engine.gcplan import Roots
from pipelines.engine.store import Store
from pipelines.gc.builds import last_builds
from pipelines.gc.checkout import Checkout, Named, checkout_names
from pipelines.gc.inventory import model_folders
from pipelines.stages.deploy.records import Records
from pipelines.stages.images.registry import Registry
from pipelines.stages.weights.stage import staging_lock

# An image as records and builds name it: host[:port]/repository@sha256:<hex>.
IMAGE_REF = re.compile(r"([A-Za-z0-9.\[\]:-]+)/([a-z0-9._/-]+)@(sha256:[0-9a-f]{64})")
STABLE_TAGS = ("stable", "stable-prev")
# A model folder's name as a record may hold it (`.../models/<cacheKey>`, `cacheKey: ...`).
# The checkout's own profiles and locks, for callers that name no other.
THIS_CHECKOUT = Checkout()
CACHE_KEY = re.compile(r"\b[0-9a-f]{16}\b")


@dataclass
class RootSet:
    """Roots as they are found: ref -> why (every reason, once each), images to open."""

    reach: dict[str, str] = field(default_factory=dict)
    unknown: dict[str, str] = field(default_factory=dict)
    images: dict[str, str] = field(default_factory=dict)  # image ref -> why

    def add(self, ref: str, why: str) -> None:
        """Mark ref as reached, for why (beside its other reasons)."""
        known = self.reach.get(ref)
        if known is None:
            self.reach[ref] = why
        elif why not in known.split("; "):
            self.reach[ref] = f"{known}; {why}"

    def image(self, ref: str, why: str) -> None:
        """An image whose layers stay in the layer cache."""
        self.images.setdefault(ref, why)

    def frozen(self) -> Roots:
        """The plan's view."""
        return Roots(dict(self.reach), dict(self.unknown), dict(self.images))


def deployment_roots(store: Store, roots: RootSet) -> None:
    """The live and the previous deployment of every profile with records: their documents,
    image and bench runs. A record newer than every readable one that cannot be read refuses
    gc (the live deployment is then not known), as it refuses a rollback."""
    folder = store.root / "deployments"
    for profile in sorted(p for p in folder.iterdir() if p.is_dir()) if folder.is_dir() else ():
        records = Records(profile)
        live = records.live()
        records.refuse_unread_after(live[-1]["time_ns"] if live else 0, "gc")
        if not live:
            continue
        current = live[-1]["deployment"]
        earlier = [r["deployment"] for r in live if r["deployment"]["key"] != current["key"]]
        chosen = [(current, "live")] + ([(earlier[-1], "previous")] if earlier else [])
        for deployment, which in chosen:
            why = f"the {which} deployment of {profile.name} ({deployment['key'][:16]})"
            roots.add(f"deployment:{deployment['key']}", why)
            if deployment.get("image"):
                roots.image(deployment["image"], why)
            # Every 16-hex word of the record may be the model folder it mounts: a folder
            # re-staged by mistake costs hours, a word kept by mistake costs nothing.
            for word in sorted(set(CACHE_KEY.findall(json.dumps(deployment)))):
                roots.add(f"model:{word}", f"named by {why}")


def build_roots(store: Store, keep: int, roots: RootSet) -> None:
    """The step outputs and images of each profile's last `keep` builds."""
    for profile, builds in last_builds(store.root / "builds", keep).items():
        for n, build in enumerate(builds, 1):
            why = f"build {n} of the last {keep} of {profile}"
            for name, key in sorted(build["steps"].items()):
                roots.add(f"step:{key}", f"{why} ({name})")
            for image in build.get("images", []):
                roots.image(image, why)


def building_roots(store: Store, keys: Iterable[str], roots: RootSet) -> None:
    """Temp folders whose key a builder holds the lock of: steps in progress."""
    for key in keys:
        if store.is_building(key):
            roots.add(f"building:{key}", "a step in progress (its build lock is held)")


def checkout_roots(named: Named, roots: RootSet) -> None:
    """The model folders the checkout's profiles stage and the .debs its Debian locks name."""
    for name, why in named.models.items():
        roots.add(f"model:{name}", why)
    for sha, why in named.debs.items():
        roots.add(f"deb:{sha}", why)
    for kind, why in named.unknown.items():
        roots.unknown.setdefault(kind, why)


def model_roots(weights: Path, roots: RootSet) -> None:
    """Model folders being staged now, and folders whose name is no cacheKey (what made them
    is not known, so they stay)."""
    for folder in model_folders(weights):
        if flock_held(staging_lock(folder)):
            roots.add(f"model:{folder.name}", "being staged (its staging lock is held)")
        if not CACHE_KEY.fullmatch(folder.name):
            roots.add(f"model:{folder.name}", "not named as a cacheKey: what made it is unknown")


def staged_roots(weights: Path, roots: RootSet) -> None:
    """Blobs a kept model folder links (by inode), and blobs with links outside models/ (a
    folder gc does not know: another store's, a member's); links from folders gc frees keep
    nothing."""
    blobs = weights / "blobs" / "sha256"
    if not blobs.is_dir():
        return
    linked: dict[tuple[int, int], str] = {}
    freed: dict[tuple[int, int], int] = {}
    for folder in model_folders(weights):
        kept = f"model:{folder.name}" in roots.reach or "model" in roots.unknown
        for entry in sorted(os.scandir(folder), key=lambda e: e.name):
            if entry.is_file(follow_symlinks=False):
                st = entry.stat(follow_symlinks=False)
                inode = (st.st_dev, st.st_ino)
                if kept:
                    linked.setdefault(inode, f"models/{folder.name}/{entry.name}")
                else:
                    freed[inode] = freed.get(inode, 0) + 1
    for entry in os.scandir(blobs):
        st = entry.stat(follow_symlinks=False)
        inode = (st.st_dev, st.st_ino)
        name = linked.get(inode)
        others = st.st_nlink - 1 - freed.get(inode, 0)
        if name is not None:
            roots.add(f"blob:{entry.name}", f"linked by the staged {name}")
        elif others > 0:
            roots.add(f"blob:{entry.name}", f"linked {others} time(s) outside models/")


def partial_roots(weights: Path, named: Named, roots: RootSet) -> None:
    """Partial downloads a fetch writes now (it holds the blob's writer flock), or one resumes
    from later (a current lock names the blob, not stored yet)."""
    partial = weights / "partial"
    for part in sorted(partial.glob("*.part")) if partial.is_dir() else ():
        sha = part.name.removesuffix(".part")
        if flock_held(partial / f"{sha}.writer"):
            roots.add(f"partial:{sha}", "a fetch in progress holds its writer lock")
        elif sha in named.blobs and not (weights / "blobs" / "sha256" / sha).exists():
            roots.add(f"partial:{sha}", f"the next fetch resumes from it ({named.blobs[sha]})")


def newest_bench_roots(store: Store, roots: RootSet) -> None:
    """The newest bench run of each profile (the last measurement stays, whatever it ran on)."""
    bench = store.root / "bench"
    for profile in sorted(p for p in bench.iterdir() if p.is_dir()) if bench.is_dir() else ():
        runs = sorted(p.name for p in profile.iterdir() if p.is_dir())
        if runs:
            roots.add(f"bench:{profile.name}/{runs[-1]}", f"the newest bench run of {profile.name}")


def stable_roots(roots: RootSet, registry_of: Callable[[str], Registry]) -> None:
    """`:stable` and `stable-prev` of every repository a kept image lives in."""
    repositories = sorted({m.group(1, 2) for m in map(IMAGE_REF.fullmatch, roots.images) if m})
    for host, repository in repositories:
        try:
            for tag in STABLE_TAGS:
                digest = registry_of(host).manifest_digest(repository, tag)
                if digest:
                    roots.image(f"{host}/{repository}@{digest}", f"{repository}:{tag}")
        except PipelineError as err:
            roots.unknown.setdefault("layer", f"{repository}:stable unknown ({err})")


def layer_roots(roots: RootSet, registry_of: Callable[[str], Registry]) -> None:
    """The layers (and config) of every kept image, from its manifest; an image whose manifest
    cannot be read keeps the whole layer cache (gc cannot tell which layers are its own)."""
    for ref, why in sorted(roots.images.items()):
        match = IMAGE_REF.fullmatch(ref)
        if match is None:
            roots.unknown.setdefault("layer", f"image {ref[:120]!r} is not host/repo@sha256:...")
            continue
        host, repository, digest = match.groups()
        try:
            found = registry_of(host).manifest(repository, digest)
        except PipelineError as err:
            roots.unknown.setdefault("layer", f"the layers of {ref} unknown ({err})")
            continue
        layers = manifest_layers(found[0]) if found else None
        if layers is None:
            roots.unknown.setdefault("layer", f"the layers of {ref} unknown (no manifest)")
            continue
        for layer in layers:
            roots.add(f"layer:{layer}", f"a layer of {ref.split('/')[-1][:40]} ({why})")


def manifest_layers(data: bytes) -> list[str] | None:
    """The blob digests an image manifest names (config and layers); None if it is not one."""
    try:
        manifest: Any = json.loads(data)
        blobs = [manifest["config"], *manifest["layers"]]
        digests = [b["digest"] for b in blobs]
    except (ValueError, KeyError, TypeError, RecursionError):
        return None
    if not all(isinstance(d, str) and re.fullmatch(r"sha256:[0-9a-f]{64}", d) for d in digests):
        return None
    return digests


def gather_roots(
    store: Store,
    weights: Path,
    keep_builds: int,
    building: Iterable[str],
    registry_of: Callable[[str], Registry],
    checkout: Checkout = THIS_CHECKOUT,
) -> Roots:
    """Every root gc knows, with why."""
    roots = RootSet()
    named = checkout_names(checkout)
    deployment_roots(store, roots)
    build_roots(store, keep_builds, roots)
    building_roots(store, building, roots)
    checkout_roots(named, roots)
    model_roots(weights, roots)
    staged_roots(weights, roots)  # after the model folders' roots: it links from kept ones
    partial_roots(weights, named, roots)
    newest_bench_roots(store, roots)
    stable_roots(roots, registry_of)
    layer_roots(roots, registry_of)
    return roots.frozen()
