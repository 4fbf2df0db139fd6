"""The one shape of a deploy target."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Target:
    """What one `deploy:` value means: its renderers, deploy backend and fabric launcher."""

    name: str  # the profile's `deploy:` value
    # runtime -> the renderer, `module:function` (stages/render/); the rings' renderers add the
    # fabric check's documents (render/fabric.py) to the service's.
    renderers: Mapping[str, str]
    # `module:function`(profile, engines by member, timeout_s, kube) -> the deploy Backend
    backend: str
    # `module:function`(profile, fabric settings) -> the fabric check's launcher
    launcher: str
    # True: a ring's weights are staged by Jobs in the render (the stager image goes into the
    # manifests); False: by `doit stage_ring`, containers of the stager image on each host.
    stages_in_render: bool
