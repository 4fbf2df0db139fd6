"""Pruning: what a profile's deployments made that the deployment now wanted no longer has.

Every container and object a deploy applies carries the profile's ownership label; after a
successful rollout, those the deployment does not contain are deleted and listed in its record.
`prune=no` (a doit argument) keeps them. The shape lives in pipelines/targets/pruning.py, which
the fabric check's prune shares (a stage imports no other stage's modules).
"""

from __future__ import annotations

from pipelines.targets.pruning import (
    DOCKER_OWNER_LABEL,
    OWNER_LABEL,
    PruneSettingError,
    Stray,
    owner_selector,
    prune_wanted,
    pruned_fields,
)

__all__ = [
    "DOCKER_OWNER_LABEL",
    "OWNER_LABEL",
    "PruneSettingError",
    "Stray",
    "owner_selector",
    "prune_wanted",
    "pruned_fields",
]
