"""Deploy backends, one per `deploy:` value of a profile (the Kubernetes one is still to come)."""

from __future__ import annotations

from collections.abc import Callable

from pipelines.deploy.dockerhosts import DockerHosts
from pipelines.profiles import Profile

BACKENDS: dict[str, Callable[[float], DockerHosts]] = {
    "docker": lambda timeout_s: DockerHosts(timeout_s),
}


def backend_for(profile: Profile, timeout_s: float) -> DockerHosts | None:
    """The backend of a profile's `deploy`, or None where none is built yet."""
    if profile.deploy not in BACKENDS:
        return None
    return BACKENDS[profile.deploy](timeout_s)
