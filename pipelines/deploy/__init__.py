"""The deploy stage: rendered plans onto the members, a canary gate, `:stable`, records.

Other stages use nothing from here but what is exported below. The fabric check launches its
probe the way deploy launches the runtime (the same engines, the same API layer): those names
load on first use, so `doit list` does not import the backends.
"""

from importlib import import_module

from pipelines.deploy.kubeapi import KubeAccess
from pipelines.deploy.tasks import Deploy, DeploySettings, RingStaging

# name -> module under pipelines.deploy that defines it, imported when first asked for.
LAZY = {
    "DockerHosts": "dockerhosts",
    "container_options": "dockerhosts",
    "DeployError": "health",
    "KubeApi": "kubeapi",
    "MemberHost": "plan",
}

__all__ = ["Deploy", "DeploySettings", "KubeAccess", "RingStaging", *LAZY]


def __getattr__(name: str):
    """A lazily exported name (PEP 562)."""
    if name not in LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"pipelines.deploy.{LAZY[name]}"), name)
