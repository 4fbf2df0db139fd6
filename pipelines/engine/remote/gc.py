"""`python -m pipelines.engine.remote gc`: the remote cache's entries that no root reaches and that
were written more than D days ago, and the objects no kept entry names (after D days too: an
upload writes its objects before its entry)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipelines.core.errors import BadInput
from pipelines.core.files import MiB, load_json
from pipelines.core.s3 import s3_errors
from pipelines.engine.gcplan import Item, Roots, gc_plan, report
from pipelines.engine.remote.entries import HEX64, MAX_INDEX_BYTES
from pipelines.engine.remote.remote import CacheUnreachable, RemoteCache

DAY_S = 86400.0
# A roots file lists step keys: a few thousand at most; a file past this is not one gc wrote.
ROOTS_MAX_BYTES = 16 * MiB


class BadRoots(BadInput):
    """A roots file that cannot be read."""


@dataclass(frozen=True)
class Stored:
    """One object under the cache's prefix: its key there, bytes, and when it was written."""

    name: str
    size: int
    written: float


def cache_items(stored: Iterable[Stored], prefix: str) -> list[Item]:
    """The entries (reached as `key:<key>` and `entry:<key>`) and objects (`object:<sha256>`)
    among what the prefix holds; names of neither shape are not the cache's and stay."""
    items = []
    for s in stored:
        rest = s.name.removeprefix(f"{prefix}/")
        entry = re.fullmatch(r"entries/([0-9a-f]{64})\.json", rest)
        blob = re.fullmatch(r"objects/sha256/([0-9a-f]{64})", rest)
        if entry:
            key = entry.group(1)
            items.append(
                Item("entry", f"entries/{key[:16]}", s.size, (f"key:{key}", f"entry:{key}"))
            )
        elif blob:
            items.append(Item("object", f"objects/{blob.group(1)[:16]}", s.size, (s.name,)))
    return items


def young_roots(stored: Iterable[Stored], prefix: str, now: float, days: float) -> dict[str, str]:
    """Entries and objects written less than `days` ago: ref -> why."""
    reach: dict[str, str] = {}
    for s in stored:
        age = (now - s.written) / DAY_S
        if age >= days:
            continue
        why = f"written {age:.1f} days ago (under {days:g})"
        entry = re.fullmatch(rf"{re.escape(prefix)}/entries/([0-9a-f]{{64}})\.json", s.name)
        reach[f"entry:{entry.group(1)}" if entry else s.name] = why
    return reach


def named_objects(index: bytes) -> list[str] | None:
    """The sha256s an entry's index names (signature not checked: an entry gc cannot trust
    keeps its objects all the same); None when it is not an entry."""
    try:
        envelope: Any = json.loads(index)
        hexes = [f["sha256"] for f in envelope["index"]["files"]]
    except (ValueError, KeyError, TypeError, RecursionError):
        return None
    return hexes if all(isinstance(h, str) and HEX64.fullmatch(h) for h in hexes) else None


def read_roots(paths: Iterable[Path]) -> dict[str, str]:
    """`key:<key>` -> why, from roots files (`doit gc` writes `<store>/gc/roots.json`)."""
    reach: dict[str, str] = {}
    for path in paths:
        data = load_json(path, ROOTS_MAX_BYTES, BadRoots)
        keys = data.get("steps") if isinstance(data, dict) else None
        if not isinstance(keys, list) or not all(
            isinstance(k, str) and HEX64.fullmatch(k) for k in keys
        ):
            raise BadRoots(f"{path}: field 'steps': expected a list of step keys (64 hex digits)")
        for key in keys:
            reach.setdefault(f"key:{key}", f"a root of {path}")
    return reach


def listing(cache: RemoteCache) -> Iterator[Stored]:
    """Everything under the cache's prefix."""
    pages = cache.client.get_paginator("list_objects_v2")
    with s3_errors(f"{cache.name}: listing", CacheUnreachable):
        for page in pages.paginate(Bucket=cache.bucket, Prefix=f"{cache.prefix}/"):
            for o in page.get("Contents", []):
                yield Stored(o["Key"], o["Size"], o["LastModified"].timestamp())


def entry_bytes(cache: RemoteCache, key: str) -> bytes | None:
    """An entry's bytes (None past the index cap: it is no entry of ours)."""
    with s3_errors(f"{cache.name}: entry {key[:16]}", CacheUnreachable):
        got = cache.client.get_object(Bucket=cache.bucket, Key=cache.entry_key(key))
        data: bytes = got["Body"].read(MAX_INDEX_BYTES + 1)
    return None if len(data) > MAX_INDEX_BYTES else data


def cache_roots(
    cache: RemoteCache,
    items: list[Item],
    kept_keys: Mapping[str, str],
    young: Mapping[str, str],
) -> Roots:
    """Entries the roots or their age keep, and the objects those entries name; an entry kept
    that cannot be read keeps every object (gc cannot tell which are its own)."""
    reach = {**young, **kept_keys}
    unknown: dict[str, str] = {}
    for item in items:
        if item.kind != "entry" or not any(r in reach for r in item.refs):
            continue
        key = item.refs[0].removeprefix("key:")
        data = entry_bytes(cache, key)
        hexes = named_objects(data) if data is not None else None
        if hexes is None:
            unknown.setdefault(
                "object", f"entry {key[:16]} kept but unreadable: its objects unknown"
            )
            continue
        for sha in hexes:
            reach.setdefault(cache.object_key(sha), f"named by entry {key[:16]}")
    return Roots(reach, unknown)


def delete(cache: RemoteCache, dead: list[Item]) -> None:
    """Entries first (an entry never names a deleted object), then objects."""
    names = [cache.entry_key(i.refs[0].removeprefix("key:")) for i in dead if i.kind == "entry"]
    names += [i.refs[0] for i in dead if i.kind == "object"]
    with s3_errors(f"{cache.name}: deleting", CacheUnreachable):
        for start in range(0, len(names), 1000):  # S3 takes 1000 keys per call
            batch: list[Any] = [{"Key": n} for n in names[start : start + 1000]]
            cache.client.delete_objects(
                Bucket=cache.bucket, Delete={"Objects": batch, "Quiet": True}
            )


def collect_cache(url: str, days: float, roots: list[Path], really: bool, now: float) -> list[str]:
    """The report of a gc of the cache at url (s3://BUCKET/PREFIX); with really, it deletes."""
    if days < 0:
        raise BadInput(f"--days {days:g}: expected 0 or more")
    kept_keys = read_roots(roots)
    cache = RemoteCache(url, {}, None, readonly=not really)
    stored = list(listing(cache))
    items = cache_items(stored, cache.prefix)
    verdicts = gc_plan(
        items, cache_roots(cache, items, kept_keys, young_roots(stored, cache.prefix, now, days))
    )
    if really:
        delete(cache, [v.item for v in verdicts if not v.alive])
    lines = report(verdicts, really)
    if not roots:
        lines.append("no --roots file: entries are kept by their age alone")
    return lines
