"""Plain Docker hosts: launch plans, a container per member on its own engine (unix:// or
ssh://), ring staging by `doit stage_ring`, the fabric check as containers."""

from pipelines.targets.target import Target

TARGET = Target(
    name="docker",
    renderers={
        "sglang": "pipelines.stages.render.fabric:docker_with_fabric",
        "simulated": "pipelines.stages.render.docker:render_simulated",
    },
    backend="pipelines.stages.deploy.backends:docker_backend",
    launcher="pipelines.stages.fabric.launch:docker_launcher",
    stages_in_render=False,
)
