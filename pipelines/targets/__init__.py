"""Deploy targets, one module each in one table (as pre-commit's languages): what a profile's
`deploy:` value means to render, deploy and the fabric check.

Each target names its parts as `module:name` strings, imported when a task uses them: `doit
list` imports no backend, and no stage imports another through this table.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from pipelines.core.profiles import Profile, ProfileError
from pipelines.targets import docker, kubernetes
from pipelines.targets.target import Target

TARGETS: dict[str, Target] = {target.name: target for target in (docker.TARGET, kubernetes.TARGET)}

__all__ = ["TARGETS", "Target", "load", "renderer_for", "target_of"]


def target_of(profile: Profile) -> Target:
    """The target of the profile's `deploy:` (the profile's schema allows only these)."""
    return TARGETS[profile.deploy]


def renderer_for(profile: Profile, path: Path | None = None) -> str:
    """The renderer of the profile's (deploy, runtime), or ProfileError naming the pair."""
    renderer = target_of(profile).renderers.get(profile.runtime)
    if renderer is None:
        known = ", ".join(f"{t.name}+{r}" for t in TARGETS.values() for r in t.renderers)
        where = path or f"profile {profile.name}"
        raise ProfileError(
            f"{where}: fields 'deploy' and 'runtime': {profile.deploy}+{profile.runtime} is not"
            f" supported; expected one of: {known}"
        )
    return renderer


def load(ref: str) -> Any:
    """What a `module:name` reference of a target names, imported now."""
    module, name = ref.split(":")
    return getattr(importlib.import_module(module), name)
