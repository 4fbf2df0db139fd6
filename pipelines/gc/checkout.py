"""What this checkout's profiles and locks name, for gc's roots: the model folders its profiles
stage, the blobs its model locks name, the .debs its Debian locks name."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from pipelines.core.errors import PipelineError
from pipelines.core.modellock import cache_key, load_lock, lock_path
from pipelines.core.paths import IMAGES_DIR, LOCKS_DIR, PROFILES_DIR
from pipelines.core.profiles import parse_profile
from pipelines.stages.images.debian_lock import LOCK_NAME, load_debian_lock


@dataclass
class Named:
    """name -> why, per kind (model folder, blob, deb); kinds gc could not learn all of."""

    models: dict[str, str] = field(default_factory=dict)
    blobs: dict[str, str] = field(default_factory=dict)
    debs: dict[str, str] = field(default_factory=dict)
    unknown: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Checkout:
    """Where the checkout keeps profiles (its own, and SPARKFORGE_PROFILES'), model locks and
    images (their Debian locks)."""

    profiles: tuple[Path, ...] = (PROFILES_DIR,)
    locks: Path = LOCKS_DIR
    images: Path = IMAGES_DIR


def checkout_names(checkout: Checkout) -> Named:
    """What the checkout's profiles and locks name; a file that cannot be read makes its kind
    unknown (gc then keeps every item of it, and says why)."""
    named = Named()
    for path in profile_files(checkout.profiles):
        try:
            profile = parse_profile(path)
        except PipelineError as err:
            # Which model folder and lock an unreadable profile names is not known.
            named.unknown.setdefault("model", f"profile unreadable: {err}")
            named.unknown.setdefault("partial", f"profile unreadable: {err}")
            continue
        model = profile.model
        named.models.setdefault(cache_key(model.source), f"the model folder of profile {path.stem}")
        lock_file = lock_path(model.lock, checkout.locks)
        try:
            lock = load_lock(lock_file)
        except PipelineError as err:
            named.unknown.setdefault("partial", f"lock unreadable: {err}")
            continue
        # The render links the lock's source's folder: the same one, unless a lock moved.
        named.models.setdefault(cache_key(lock.source), f"the model folder of lock {lock.model}")
        for entry in lock.files:
            if entry.sha256:
                named.blobs.setdefault(entry.sha256, f"{lock_file.name}: {entry.name}")
    for path in sorted(checkout.images.glob(f"*/{LOCK_NAME}")):
        try:
            debian = load_debian_lock(path)
        except PipelineError as err:
            named.unknown.setdefault("deb", f"Debian lock unreadable: {err}")
            continue
        for arch, debs in sorted(debian.archs.items()):
            for deb in debs:
                why = f"{path.parent.name}'s Debian lock: {deb.name} {deb.version} ({arch})"
                named.debs.setdefault(deb.sha256, why)
    return named


def profile_files(folders: Iterable[Path]) -> list[Path]:
    """The profile files of each folder, once each."""
    return sorted({p.absolute() for folder in folders for p in folder.glob("*.yaml")})
