"""Test equipment: tp3-ring rendered with ring staging of a made-up complete lock."""

from __future__ import annotations

import hashlib

from pipelines.core.modellock import LockEntry, load_lock, lock_path
from pipelines.core.paths import PATCH_SOURCE
from pipelines.core.profiles import load_profile
from pipelines.stages.render.documents import Document, RenderInputs
from pipelines.stages.render.kubernetes import render
from pipelines.stages.weights.ringplan import RingNode, plan_json, plan_ring


def staged_tp3_render(
    version: str, image: str, stager: str, secrets: list[str] | None = None
) -> list[Document]:
    """tp3-ring's documents with ring staging of a lock whose bytes are named by version."""
    profile = load_profile("tp3-ring")
    lock = load_lock(lock_path(profile.model.lock))
    files = [
        LockEntry(
            name=e.name,
            size=1000 + i,
            sha256=hashlib.sha256((version + e.name).encode()).hexdigest(),
        )
        for i, e in enumerate(lock.files)
    ]
    lock = type(lock)(model=lock.model, source=lock.source, files=files)
    nodes = [RingNode(m.node, m.address, dict(m.links)) for m in profile.members]
    plan = plan_ring(
        lock.model,
        lock.source,
        hashlib.sha256(version.encode()).hexdigest(),
        [(e.name, e.size, e.sha256) for e in files],
        nodes,
        profile.staging.port,
        profile.staging.peer_wait_s,
    )
    inputs = RenderInputs(lock, image, PATCH_SOURCE.read_text(), "", stager, plan_json(plan))
    return render(profile, inputs, secrets or [])
