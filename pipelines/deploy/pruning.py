"""Pruning: what a profile's deployments made that the deployment now wanted no longer has.

Every container and object a deploy applies carries the profile's ownership label; after a
successful rollout, those the deployment does not contain are deleted and listed in its record.
`prune=no` (a doit argument) keeps them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipelines.errors import BadInput

# Kubernetes: the label every object a deploy applies carries (its value: the profile's name).
OWNER_LABEL = "sparkforge.dev/profile"


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
