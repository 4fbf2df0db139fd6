"""The render stage: manifests (Kubernetes) or launch plans (Docker hosts), validated offline."""

from pipelines.stages.render.tasks import Render

__all__ = ["Render"]
