"""Pruning: what a profile's stages applied that their newest render no longer has.

Every object and container the deploy or the fabric check applies carries the profile's
ownership label; the fabric check's also carry the part label (`fabric`), which deploy's never
do, so each stage's prune selects only its own. After a run, those the render does not contain
are deleted and listed in the stage's record. `prune=no` (a doit argument) keeps them. Below
both stages (the fabric stage imports no deploy module), as the targets they both reach are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipelines.core.errors import BadInput

# Kubernetes: the label every object a deploy or a fabric check applies carries (its value:
# the profile's name), and the one that says which part of the profile applied it (absent:
# the deployment).
OWNER_LABEL = "sparkforge.dev/profile"
PART_LABEL = "sparkforge.dev/part"
# Docker hosts: the same two, in Docker's reverse-DNS label style.
DOCKER_OWNER_LABEL = "dev.sparkforge.profile"
DOCKER_PART_LABEL = "dev.sparkforge.part"
FABRIC = "fabric"


class PruneSettingError(BadInput):
    """A `prune=` argument that is neither yes nor no."""


@dataclass(frozen=True)
class Stray:
    """A container or object the profile owns that the deployment does not contain."""

    what: str  # one line naming it and where it is
    entry: dict[str, Any]  # what the record keeps of it (enough to find it, or make it again)


def prune_wanted(value: str) -> bool:
    """Whether `prune=` asks for pruning ("" and yes: prune; no: keep)."""
    if value in ("", "yes"):
        return True
    if value == "no":
        return False
    raise PruneSettingError(f"doit argument prune={value!r}: expected prune=yes or prune=no")


def owner_labels(profile: str, part: str) -> dict[str, str]:
    """The Kubernetes labels of what a part (fabric) of a profile applies."""
    return {OWNER_LABEL: profile, PART_LABEL: part}


def owner_selector(profile: str, part: str | None) -> str:
    """The label selector of what a part of a profile applied; None: the deployment's, which
    leaves out every part's objects."""
    if part is None:
        return f"{OWNER_LABEL}={profile},!{PART_LABEL}"
    return f"{OWNER_LABEL}={profile},{PART_LABEL}={part}"


def pruned_fields(pruned: list[Stray], failed: list[str]) -> dict[str, Any]:
    """What a record keeps of a prune: each deleted stray's entry, and what failed."""
    fields: dict[str, Any] = {"pruned": [stray.entry for stray in pruned]}
    if failed:
        fields["prune_failed"] = failed
    return fields
