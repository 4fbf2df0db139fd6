"""A profile's ring staging plan (`doit plan_weights`): made from its members and its lock,
printed, and written where each member's run reads it."""

from __future__ import annotations

from pathlib import Path

from pipelines.core.files import write_atomic
from pipelines.core.modellock import Lock
from pipelines.core.profiles import Profile
from pipelines.core.progress import show
from pipelines.stages.weights.ringplan import (
    RingNode,
    RingPlan,
    describe_plan,
    plan_json,
    plan_ring,
)


def profile_ring_plan(profile: Profile, lock: Lock, lock_sha256: str) -> RingPlan:
    """Who fetches which file from S3 and from which peers (a pure function of the lock)."""
    nodes = [RingNode(m.node, m.address, dict(m.links)) for m in profile.members]
    entries = [(e.name, e.locked_size, e.locked_sha256) for e in lock.files]
    staging = profile.staging
    return plan_ring(
        lock.model, lock.source, lock_sha256, entries, nodes, staging.port, staging.peer_wait_s
    )


def write_ring_plan(plan: RingPlan, path: Path, weights_root: str) -> None:
    """Print the plan, write it to path, and say how each member runs it."""
    show(describe_plan(plan))
    write_atomic(path, plan_json(plan).encode())
    show(
        f"plan_weights: wrote {path}; each member N runs"
        " `python -m pipelines.stages.weights.ring"
        f" --plan {path.name} --rank N --root {weights_root}`"
    )
