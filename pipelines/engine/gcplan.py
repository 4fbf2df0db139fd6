"""What a gc keeps and frees (the store's, the remote cache's), decided from an inventory and
its roots alone: no disk, no network."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

# The kinds of things gc collects, in the order it reports them: the store's, then the remote
# cache's.
KINDS = (
    "step", "tmp", "layer", "model", "blob", "partial", "deb", "bench", "tag", "entry", "object"
)  # fmt: skip


@dataclass(frozen=True)
class Item:
    """One thing the store holds: its kind, its name there, its bytes, and the names roots
    reach it by (`step:<key>`, `layer:<digest>`, `blob:<sha256>`, `deployment:<key>`,
    `model:<cacheKey>`, `partial:<sha256>`, `deb:<sha256>`)."""

    kind: str
    name: str
    size: int
    refs: tuple[str, ...]


@dataclass(frozen=True)
class Verdict:
    """An item, whether gc keeps it, and why (every root that reaches it, or why not)."""

    item: Item
    alive: bool
    why: str


@dataclass(frozen=True)
class Roots:
    """What must stay: ref -> why it is a root; kinds whose roots could not all be learnt
    (kind -> why), whose every item then stays."""

    reach: Mapping[str, str]
    unknown: Mapping[str, str]
    # The images (host/repository@digest) the roots keep, and why: the registry's tags follow.
    images: Mapping[str, str] = field(default_factory=dict)


def gc_plan(items: Iterable[Item], roots: Roots) -> list[Verdict]:
    """Each item with its verdict, in KINDS order then by name."""
    verdicts = []
    for item in sorted(items, key=lambda i: (KINDS.index(i.kind), i.name)):
        whys = [roots.reach[r] for r in item.refs if r in roots.reach]
        if whys:
            verdicts.append(Verdict(item, True, "; ".join(whys)))
        elif item.kind in roots.unknown:
            verdicts.append(Verdict(item, True, f"kept: {roots.unknown[item.kind]}"))
        else:
            verdicts.append(Verdict(item, False, "no root reaches it"))
    return verdicts


def kept_step_keys(verdicts: Iterable[Verdict], roots: Roots) -> list[str]:
    """The step keys gc keeps here and those its roots name (stored here or not): what the
    remote cache's gc keeps too."""
    kept = {v.item.refs[0] for v in verdicts if v.alive and v.item.kind in ("step", "layer")}
    kept |= {ref for ref in roots.reach if ref.startswith("step:")}
    return sorted(ref.removeprefix("step:") for ref in kept)


def freed_bytes(verdicts: Iterable[Verdict]) -> int:
    """The bytes the dead items hold."""
    return sum(v.item.size for v in verdicts if not v.alive)


def report(verdicts: list[Verdict], deleting: bool) -> list[str]:
    """One line per item and a total per kind, as `doit gc` prints them."""
    lines = []
    for v in verdicts:
        state = "keep" if v.alive else ("free" if deleting else "would free")
        lines.append(f"{state:10} {v.item.kind:6} {v.item.name} ({v.item.size:,} B): {v.why}")
    for kind in KINDS:
        mine = [v for v in verdicts if v.item.kind == kind]
        if mine:
            dead = [v for v in mine if not v.alive]
            lines.append(
                f"{kind}: {len(mine) - len(dead)} kept, {len(dead)} to free"
                f" ({freed_bytes(dead):,} B)"
            )
    verb = "freed" if deleting else "would free"
    lines.append(f"total: {verb} {freed_bytes(verdicts):,} B")
    return lines
