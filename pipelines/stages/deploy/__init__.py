"""The deploy stage: rendered plans onto the members, a canary gate, `:stable`, records.

Other stages use nothing from here but what is exported below (dodo.py: `Deploy.live` for the
bench). The fabric check launches its probe through the same clients as deploy, which live beside
the targets (pipelines/targets/dockerengines.py, kubeapi.py), not here.
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

from pipelines.stages.deploy.ringstage import RingStaging
from pipelines.stages.deploy.tasks import Deploy, DeploySettings

if TYPE_CHECKING:
    from pipelines.stages.deploy.docker import DockerHosts

# name -> module under pipelines.stages.deploy that defines it, imported when first asked for.
LAZY = {"DockerHosts": "docker"}

__all__ = ["Deploy", "DeploySettings", "DockerHosts", "RingStaging"]


def __getattr__(name: str) -> Any:  # PEP 562: the name's own type (TYPE_CHECKING above)
    """A lazily exported name (PEP 562)."""
    if name not in LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"pipelines.stages.deploy.{LAZY[name]}"), name)
