"""What the edge tells the fabric stage: its settings, apart from the stage and the launchers
that both read them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pipelines.core.profiles import Profile
from pipelines.core.site import Site
from pipelines.targets.kubeapi import KubeAccess

# A 1 GiB sweep at the Socket fallback's ~3 GB/s takes minutes; a hung rendezvous takes forever.
DEFAULT_TIMEOUT_S = 900


@dataclass(frozen=True)
class FabricSettings:
    """What the edge tells the fabric stage."""

    site: Site  # the Docker engines by member (the local stack's), read on first use
    who: str
    git: Callable[[], str]
    kube: KubeAccess = KubeAccess()
    timeout_s: float = DEFAULT_TIMEOUT_S
    expect: str = ""  # `expect=P2P>=200`: replaces the profile's expectations (a hand check)
    prune: bool = True  # `prune=no`: keep what an earlier render applied and this one lacks
    # (profile, settings) -> launcher; None: the profile's deploy decides (launch.py)
    launcher: Callable[[Profile, FabricSettings], Any] | None = None
