"""Deploy backends, one per `deploy:` value of a profile: the same interface for each."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from pipelines.core.profiles import Profile
from pipelines.stages.deploy.docker import DockerHosts
from pipelines.stages.deploy.fielddiff import ObjectDiff
from pipelines.stages.deploy.kubernetes import Kubernetes
from pipelines.stages.deploy.plan import Deployment
from pipelines.targets import load, target_of
from pipelines.targets.kubeapi import KubeAccess
from pipelines.targets.pruning import Stray


class Backend(Protocol):
    """Preflight, apply, wait for health, read what runs, restore what was there."""

    # True: every change is a server-side dry run, nothing is applied (only the Kubernetes API
    # has one; SPARKFORGE_KUBE_DRY_RUN asks for it).
    dry_run: bool

    def engines(self) -> tuple[str, ...]:
        """Each member's Docker URL, by rank (none for a cluster: it uses no local engine)."""

    def load(self, key: str, folder: Path) -> Deployment:
        """The deployment a render step wrote into folder, under its key."""

    def endpoint(self, deployment: Deployment) -> str | None:
        """The service's base URL as this runner reaches it (None: not reachable from here)."""

    def preflight(
        self, deployment: Deployment, swap_off: bool, min_free: int, lock_sha256: str = ""
    ) -> list[str]:
        """Problems found before anything is touched, one line each (lock_sha256: the lock
        every member's staged model folder must come from)."""

    def apply(self, deployment: Deployment) -> list[Any]:
        """Apply; returns the changes restore undoes (on an exception: `err.changes`)."""

    def wait(self, deployment: Deployment, served_name: str) -> None:
        """Return when every member serves; DeployError on timeout or failure."""

    def restore(self, changes: list[Any], profile: str) -> None:
        """Undo apply's changes: the previous deployment runs again."""

    def commit(self, changes: list[Any]) -> None:
        """Forget what restore would have needed, once the new deployment serves."""

    def running(self, deployment: Deployment) -> list[str]:
        """One line per member: what runs there now."""

    def close(self) -> None:
        """Let go of connections (clients, ssh forwards)."""

    def diff(self, deployment: Deployment) -> list[ObjectDiff]:
        """What apply would change, per member or object, field by field; touches nothing."""

    def drift(self, deployment: Deployment) -> list[ObjectDiff]:
        """What differs now from what the deployment applied, per member or object (changed by
        hand since), field by field; touches nothing."""

    def strays(self, deployment: Deployment, earlier: Deployment | None) -> list[Stray]:
        """What carries the profile's ownership label but is not in the deployment (where the
        deployment or the earlier one runs); touches nothing."""

    def prune(self, strays: list[Stray]) -> list[str]:
        """Delete the strays; one line per one that could not be deleted."""

    def validate(self, deployment: Deployment) -> list[str]:
        """What is wrong with a deployment read from a record, one line per field: a record
        is hostile input, and rollback applies what it holds."""


def docker_backend(
    profile: Profile, engines: tuple[str, ...], timeout_s: float, kube: KubeAccess | None
) -> Backend:
    """Docker hosts: each member's engine (the local stack's, by member, or its URL)."""
    return DockerHosts(profile, engines, timeout_s)


def kubernetes_backend(
    profile: Profile, engines: tuple[str, ...], timeout_s: float, kube: KubeAccess | None
) -> Backend:
    """The Kubernetes API server the access names (a cluster uses no local engine)."""
    return Kubernetes(profile, engines, timeout_s, kube)


def backend_for(
    profile: Profile,
    local_engines: tuple[str, ...],
    timeout_s: float,
    kube: KubeAccess | None = None,
) -> Backend:
    """The deploy backend of the profile's target (pipelines/targets/)."""
    make: Callable[..., Backend] = load(target_of(profile).backend)
    return make(profile, local_engines, timeout_s, kube)
