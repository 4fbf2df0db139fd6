"""Where a run's registry and Docker engines answer, read only when a task first needs them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

# (registry as host[:port], the Docker engines by member; empty where no engine is used)
Located = tuple[str, tuple[str, ...]]


@dataclass(frozen=True)
class Site:
    """A profile's registry and engines: named by the profile, or those of the local stack.

    The local stack's are read from its endpoints file on first use, never when the task graph
    is loaded, so `doit list` and `doit help` need nothing running.
    """

    locate: Callable[[], Located]
    namespace: str = ""  # the registry path every repository goes under ("" for none)

    @classmethod
    def named(cls, registry: str, namespace: str | None = None) -> Site:
        """The site of a profile that names its registry (host[:port][/path]); no engines."""
        host, _, path = registry.partition("/")
        return cls(lambda: (host, ()), join_namespace(path, namespace))

    @cached_property
    def located(self) -> Located:
        """The registry and engines, read once."""
        return self.locate()

    @property
    def registry(self) -> str:
        """The registry as host[:port]."""
        return self.located[0]

    @property
    def docker_hosts(self) -> tuple[str, ...]:
        """The Docker engines by member (the local stack's), or none."""
        return self.located[1]

    @property
    def docker_host(self) -> str | None:
        """The engine images are built with: the first member's, or None (buildx)."""
        return self.docker_hosts[0] if self.docker_hosts else None


def join_namespace(*parts: str | None) -> str:
    """Registry path parts joined with '/', empty ones left out."""
    return "/".join(part for part in parts if part)
