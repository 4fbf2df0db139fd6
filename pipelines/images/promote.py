"""Moving `:stable`: the candidate's exact manifest bytes re-put under the tag, no layer moved."""

from __future__ import annotations

from pipelines.images.registry import Registry
from pipelines.images.spec import ImageError

STABLE = "stable"
STABLE_PREV = "stable-prev"


def promote(registry: Registry, repo: str, digest: str) -> str:
    """Point `stable` at digest, keeping the old one as `stable-prev`; says what it did."""
    current = registry.manifest_digest(repo, STABLE)
    if current == digest:
        return f"{repo}:{STABLE} already at {digest}"
    candidate = registry.manifest(repo, digest)
    if candidate is None:
        raise ImageError(f"registry {registry.host}: {repo}@{digest} not found: nothing promoted")
    if current is not None:
        previous = registry.manifest(repo, current)
        if previous is not None:
            registry.push_manifest(repo, STABLE_PREV, *previous)
    registry.push_manifest(repo, STABLE, *candidate)
    return f"{repo}:{STABLE} -> {digest} (was {current or 'unset'})"


def restore_previous(registry: Registry, repo: str) -> str:
    """Point `stable` back at `stable-prev`; says what it did."""
    previous = registry.manifest(repo, STABLE_PREV)
    if previous is None:
        raise ImageError(f"registry {registry.host}: {repo}:{STABLE_PREV} not found: no rollback")
    digest = registry.push_manifest(repo, STABLE, *previous)
    return f"{repo}:{STABLE} -> {digest} (restored from {STABLE_PREV})"


def stable_digest(registry: Registry, repo: str) -> str | None:
    """The digest `stable` points to, if any."""
    return registry.manifest_digest(repo, STABLE)
