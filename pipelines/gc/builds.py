"""The build log: which step keys and images each finished `doit build` of a profile used
(`<store>/builds/<profile>/<time_ns>.json`), so gc keeps the last N builds' outputs."""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

from pipelines.core.errors import BadInput
from pipelines.core.files import MiB, load_json_object, write_atomic
from pipelines.core.progress import say

# A build names a handful of steps and images; a file past this is not one gc wrote.
BUILD_MAX_BYTES = 1 * MiB


class CorruptBuild(BadInput):
    """A build log entry that cannot be read."""


class BuildFields(msgspec.Struct):
    """What gc reads of a build: its time, step keys by name, image references."""

    profile: str
    finished: float
    steps: dict[str, str]
    images: list[str] = []


def log_build(folder: Path, profile: str, steps: dict[str, str], images: list[str]) -> Path:
    """Keep one build's step keys and images (written whole or not at all)."""
    path = folder / profile / f"{time.time_ns()}.json"
    record = {"profile": profile, "finished": time.time(), "steps": steps, "images": images}
    write_atomic(path, (json.dumps(record, indent=2, sort_keys=True) + "\n").encode())
    return path


def read_build(path: Path) -> dict[str, Any]:
    """One build, or CorruptBuild naming the file (and field)."""
    return load_json_object(path, BUILD_MAX_BYTES, CorruptBuild, BuildFields)


def last_builds(folder: Path, keep: int) -> dict[str, list[dict[str, Any]]]:
    """Profile -> its newest `keep` readable builds, newest first; each unreadable one is
    named on stderr and left out."""
    profiles = sorted(folder.iterdir()) if folder.is_dir() else []
    return {p.name: profile_builds(p, keep) for p in profiles}


def profile_builds(folder: Path, keep: int) -> list[dict[str, Any]]:
    """One profile's newest `keep` readable builds, newest first."""
    paths = sorted(
        (p for p in folder.glob("*.json") if re.fullmatch(r"[0-9]+", p.stem)),
        key=lambda p: int(p.stem),
        reverse=True,
    )
    kept: list[dict[str, Any]] = []
    for path in paths:
        if len(kept) == keep:
            break
        try:
            kept.append(read_build(path))
        except CorruptBuild as err:
            say("gc", f"build log skipped: {err}", stream=sys.stderr)
    return kept


def write_roots(folder: Path, keys: list[str]) -> Path:
    """Publish the step keys gc's roots reach (`roots.json`), for the remote cache's gc."""
    path = folder / "roots.json"
    record = {"steps": keys, "written": time.time()}
    write_atomic(path, (json.dumps(record, indent=1, sort_keys=True) + "\n").encode())
    return path
