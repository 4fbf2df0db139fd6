"""Moving `:stable`: the candidate's exact manifest bytes re-put under the tag, no layer moved."""

from __future__ import annotations

from collections.abc import Callable

from pipelines.stages.images.registry import Registry
from pipelines.stages.images.spec import ImageError

STABLE = "stable"
STABLE_PREV = "stable-prev"


def promote(registry: Registry, repo: str, digest: str) -> str:
    """Point `stable` at digest, keeping the old one as `stable-prev`; says what it did."""
    current = move_stable(registry, repo, digest)
    if current == digest:
        return f"{repo}:{STABLE} already at {digest}"
    return f"{repo}:{STABLE} -> {digest} (was {current or 'unset'})"


def stable_back_to(registry: Registry, repo: str, digest: str) -> str:
    """Point `stable` at the image of the deployment a rollback restored (digest), the one it
    replaces kept as `stable-prev`; says what it did."""
    current = move_stable(registry, repo, digest)
    if current == digest:
        return f"{repo}:{STABLE} already at {digest}, the restored deployment's image"
    return (
        f"{repo}:{STABLE} -> {digest}, the restored deployment's image"
        f" ({STABLE_PREV} -> {current or 'unset'})"
    )


def move_stable(registry: Registry, repo: str, digest: str) -> str | None:
    """Point `stable` at digest and the digest it left as `stable-prev`; the digest it left."""
    # Not `stable` := `stable-prev`: stable-prev moves only when stable changes digest, so
    # after two deployments of one image it is unset or names an older image than the one the
    # restored deployment runs (the record holds that one, by digest).
    current = registry.manifest_digest(repo, STABLE)
    if current == digest:
        return current
    candidate = registry.manifest(repo, digest)
    if candidate is None:
        raise ImageError(f"registry {registry.host}: {repo}@{digest} not found: {STABLE} not moved")
    if current is not None:
        previous = registry.manifest(repo, current)
        if previous is not None:
            registry.push_manifest(repo, STABLE_PREV, *previous)
    registry.push_manifest(repo, STABLE, *candidate)
    return current


def stable_digest(registry: Registry, repo: str) -> str | None:
    """The digest `stable` points to, if any."""
    return registry.manifest_digest(repo, STABLE)


class StableTag:
    """`:stable` of one repository: what deploy moves forward and rollback moves back."""

    def __init__(self, registry: Registry, repository: Callable[[], str]):
        self.registry, self.repository = registry, repository

    def promote(self, digest: str) -> str:
        """Move `:stable` to digest (the old one kept as `stable-prev`); says what it did."""
        return promote(self.registry, self.repository(), digest)

    def restore_stable(self, digest: str) -> str:
        """Move `:stable` back to digest, a restored deployment's image; says what it did."""
        return stable_back_to(self.registry, self.repository(), digest)

    def stable_digest(self) -> str | None:
        """The digest `:stable` points to now, if any."""
        return stable_digest(self.registry, self.repository())
