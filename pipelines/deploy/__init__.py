"""The deploy stage: rendered plans onto the members, a canary gate, `:stable`, records.

Other stages use nothing from here; dodo.py builds it last.
"""

from pipelines.deploy.kubeapi import KubeAccess
from pipelines.deploy.tasks import Deploy, DeploySettings

__all__ = ["Deploy", "DeploySettings", "KubeAccess"]
