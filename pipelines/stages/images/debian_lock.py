"""The lock of a local base's Debian archive: the suite's Release file and every .deb, by hash.

Like `requirements.lock` for Python: the base is built from exactly the locked .debs, so its key
(which holds the lock) names one set of bytes on any day. `doit lock_base` refreshes it on
purpose and says what moved.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import yaml
from msgspec import Meta

from pipelines.core.errors import BadInput
from pipelines.core.files import write_atomic
from pipelines.core.schema import Strict, as_data, load_yaml_model
from pipelines.stages.images.spec import LocalBase

LOCK_NAME = "debian.lock.yaml"  # beside the image's image.yaml
Sha256 = Annotated[str, Meta(pattern=r"^[0-9a-f]{64}$")]
# Debian's own rules for names, versions and pool paths: nothing that could leave the pool.
PackageName = Annotated[str, Meta(pattern=r"^[a-z0-9][a-z0-9+.-]+$")]
Version = Annotated[str, Meta(pattern=r"^[A-Za-z0-9.+~:-]+$")]
PoolPath = Annotated[str, Meta(pattern=r"^pool(/[A-Za-z0-9+_~-][A-Za-z0-9+._~-]*)+\.deb$")]


class BaseLockError(BadInput):
    """A Debian lock that is malformed or missing, or a mirror that no longer serves it."""


class Deb(Strict, frozen=True, kw_only=True):
    """One locked package: its version, where the mirror keeps it, its size and sha256."""

    name: PackageName
    version: Version
    filename: PoolPath
    size: Annotated[int, Meta(ge=0)]
    sha256: Sha256


class Release(Strict, frozen=True, kw_only=True):
    """The suite's Release file as it was locked: its Date field and its sha256."""

    date: str
    sha256: Sha256


class DebianLock(Strict, frozen=True, kw_only=True):
    """A suite of a mirror, locked: its Release, and per architecture the .debs of the base."""

    mirror: str
    suite: str
    variant: str
    include: list[PackageName]
    release: Release
    archs: dict[Annotated[str, Meta(pattern=r"^[a-z0-9]+$")], list[Deb]]

    def debs(self, spec: LocalBase, arch: str, path: Path, refresh: str) -> list[Deb]:
        """The locked .debs of an architecture for spec, or one line saying how to lock them."""
        for name, locked, asked in (
            ("mirror", self.mirror, spec.mirror),
            ("suite", self.suite, spec.suite),
            ("variant", self.variant, spec.variant),
            ("include", sorted(self.include), sorted(spec.packages)),
        ):
            if locked != asked:
                raise BaseLockError(
                    f"{path}: {name}: locked {locked!r}, image.yaml asks {asked!r}; run `{refresh}`"
                )
        if arch not in self.archs:
            raise BaseLockError(f"{path}: archs.{arch}: not locked; run `{refresh}` on {arch}")
        return self.archs[arch]


def lock_file(image_folder: Path) -> Path:
    """Where an image's Debian lock lives."""
    return image_folder / LOCK_NAME


def load_debian_lock(path: Path) -> DebianLock:
    """Read and validate a Debian lock, or raise BaseLockError with one line."""
    return load_yaml_model(path, DebianLock, BaseLockError)


def dump_debian_lock(lock: DebianLock) -> str:
    """The YAML text of a lock: a header line, then one flow mapping per .deb."""
    lines = [
        "# Debian archive lock of a local base: written by `doit lock_base`; do not edit.",
        f"mirror: {json.dumps(lock.mirror)}",  # JSON strings are YAML: quoted, whatever they hold
        f"suite: {json.dumps(lock.suite)}",
        f"variant: {json.dumps(lock.variant)}",
        f"include: {json.dumps(sorted(lock.include))}",
        f"release: {{date: {json.dumps(lock.release.date)}, sha256: {lock.release.sha256}}}",
        "archs:",
    ]
    for arch in sorted(lock.archs):
        lines.append(f"  {arch}:")
        for deb in sorted(lock.archs[arch], key=lambda d: d.name):
            flow = yaml.safe_dump(
                as_data(deb), default_flow_style=True, sort_keys=False, width=1000
            )
            lines.append(f"    - {flow.strip()}")
    return "\n".join(lines) + "\n"


def write_debian_lock(lock: DebianLock, path: Path) -> None:
    """Write a Debian lock atomically."""
    write_atomic(path, dump_debian_lock(lock).encode())


def release_change(old: DebianLock | None, new: DebianLock) -> str | None:
    """The Release line of a refresh, None when the Release file is the one locked before."""
    if old is not None and old.release == new.release:
        return None
    was = f"{old.release.date} ({old.release.sha256[:12]})" if old else "nothing"
    return f"Release: {was} -> {new.release.date} ({new.release.sha256[:12]})"


def lock_changes(old: DebianLock | None, new: DebianLock, arch: str) -> list[str]:
    """What moved between two locks of an architecture, one line per package (sorted)."""
    before = {d.name: d for d in (old.archs.get(arch, []) if old else [])}
    after = {d.name: d for d in new.archs[arch]}
    lines = []
    for name in sorted(before.keys() | after.keys()):
        a, b = before.get(name), after.get(name)
        if a is None and b is not None:
            lines.append(f"+ {name} {b.version}")
        elif b is None and a is not None:
            lines.append(f"- {name} {a.version}")
        elif a is not None and b is not None and a != b:
            lines.append(f"~ {name} {a.version} -> {b.version}")
    return lines
