"""Kubernetes with the llmkube operator: manifests by server-side apply, ring staging as Jobs
in the render, the fabric check as one Job per member."""

from pipelines.targets.target import Target

TARGET = Target(
    name="kubernetes",
    renderers={"vllm": "pipelines.stages.render.fabric:kubernetes_with_fabric"},
    backend="pipelines.stages.deploy.backends:kubernetes_backend",
    launcher="pipelines.stages.fabric.launch:kubernetes_launcher",
    stages_in_render=True,
)
