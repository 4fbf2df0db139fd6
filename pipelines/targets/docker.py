"""Plain Docker hosts: launch plans, a container per member on its own engine (unix:// or
ssh://), ring staging by `doit stage_ring`, the fabric check as containers."""

from pipelines.targets.target import Target

TARGET = Target(
    name="docker",
    renderers={
        "sglang": "pipelines.render.fabric:render_dockerhosts",
        "simulated": "pipelines.render.dockerhosts:render_simulated",
    },
    backend="pipelines.deploy.backends:docker_backend",
    launcher="pipelines.fabric.launch:docker_launcher",
    stages_in_render=False,
)
