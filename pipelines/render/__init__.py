"""The render stage: manifests (Kubernetes) or launch plans (Docker hosts), validated offline."""

from pipelines.render.tasks import RENDERERS, Render, renderer_for

__all__ = ["RENDERERS", "Render", "renderer_for"]
