"""The registry's `candidate-*` and `key-*` tags that gc collects: first seen by a gc more than
D days ago (the API keeps no tag dates, and a reproducible image's config carries a fixed one)
and on an image no root reaches and no other kept tag names. Deleting goes by digest (the
registry deletes a manifest, not a tag), so a digest goes only when every tag on it may."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

from pipelines.core.errors import BadInput
from pipelines.core.files import MiB, load_json, write_atomic
from pipelines.engine.gcplan import Item, Verdict
from pipelines.stages.images.registry import Registry

GC_TAGS = re.compile(r"(candidate|key)-[A-Za-z0-9_.-]+")
DAY_S = 86400.0
# One line per tag a gc has seen: thousands at most.
LEDGER_MAX_BYTES = 16 * MiB


class BadLedger(BadInput):
    """The first-seen ledger of tags cannot be read."""


def tag_items(repository: str, tagged: Mapping[str, str]) -> list[Item]:
    """The collectable tags (tag -> digest), reached as the image they point to
    (`image:<digest>`): a manifest goes with all its tags or not at all."""
    return [
        Item("tag", f"{repository}:{tag}", 0, (f"image:{digest}",))
        for tag, digest in sorted(tagged.items())
        if GC_TAGS.fullmatch(tag)
    ]


def tag_roots(
    repository: str,
    tagged: Mapping[str, str],
    kept_images: Mapping[str, str],
    seen: Mapping[str, float],
    now: float,
    days: float,
) -> dict[str, str]:
    """`image:<digest>` -> why: the digests a root keeps, and those a tag gc does not collect
    or a tag it first saw less than `days` ago points to."""
    reach: dict[str, str] = {}

    def add(ref: str, why: str) -> None:
        reach[ref] = f"{reach[ref]}; {why}" if ref in reach else why

    for digest, why in sorted(kept_images.items()):
        add(f"image:{digest}", why)
    for tag, digest in sorted(tagged.items()):
        if not GC_TAGS.fullmatch(tag):
            add(f"image:{digest}", f"also tagged {tag}")
            continue
        age = (now - seen.get(f"{repository}:{tag}", now)) / DAY_S
        if age < days:
            add(
                f"image:{digest}", f"tagged {tag}, first seen by gc {age:.1f} days ago (< {days:g})"
            )
    return reach


def first_seen(
    old: Mapping[str, float], repository: str, tags: Iterable[str], now: float
) -> dict[str, float]:
    """The ledger after this gc: each collectable tag of the repository with the time a gc first
    saw it (now for a new one); tags gone from the registry leave it."""
    ledger = {k: v for k, v in old.items() if not k.startswith(f"{repository}:")}
    for tag in tags:
        if GC_TAGS.fullmatch(tag):
            ledger[f"{repository}:{tag}"] = old.get(f"{repository}:{tag}", now)
    return ledger


def read_ledger(path: Path) -> dict[str, float]:
    """The first-seen ledger (empty when absent); one that cannot be read is refused."""
    if not path.exists():
        return {}
    data = load_json(path, LEDGER_MAX_BYTES, BadLedger)
    if not isinstance(data, dict) or not all(
        isinstance(k, str) and isinstance(v, int | float) for k, v in data.items()
    ):
        raise BadLedger(f"{path}: expected an object of repository:tag -> time (seconds)")
    return {k: float(v) for k, v in data.items()}


def write_ledger(path: Path, ledger: Mapping[str, float]) -> None:
    """Keep the ledger (whole or not at all)."""
    write_atomic(path, (json.dumps(dict(ledger), indent=1, sort_keys=True) + "\n").encode())


def tagged_digests(registry: Registry, repository: str) -> dict[str, str]:
    """Every tag of the repository and the digest it points to now."""
    tagged = {}
    for tag in registry.tags(repository):
        digest = registry.manifest_digest(repository, tag)
        if digest:
            tagged[tag] = digest
    return tagged


def delete_tags(registry: Registry, repository: str, verdicts: list[Verdict]) -> None:
    """Delete the manifests whose tags are all freed (the plan keeps any digest a kept tag or
    root names, so each dead tag's digest is one of these)."""
    kept = {v.item.refs[0] for v in verdicts if v.item.kind == "tag" and v.alive}
    dead = {v.item.refs[0] for v in verdicts if v.item.kind == "tag" and not v.alive}
    for ref in sorted(dead - kept):
        registry.delete_manifest(repository, ref.removeprefix("image:"))
