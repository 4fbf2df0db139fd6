"""A deployment: the rendered launch plans of a profile, under the key that rendered them."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from pipelines.deploy.health import DeployError


@dataclass(frozen=True)
class Member:
    """One member as deploy sees it: rank, node and the URL of its Docker engine."""

    rank: int
    node: str
    docker: str


@dataclass(frozen=True)
class Deployment:
    """What one deploy applies: plans by rank, each with its member's engine."""

    profile: str
    key: str  # the render step's key: same key, same deployment
    plans: tuple[dict[str, Any], ...]
    engines: tuple[str, ...]  # the Docker URL of each member, by rank

    def members(self) -> Iterator[tuple[Member, dict[str, Any]]]:
        """(member, launch plan) in rank order."""
        for plan, engine in zip(self.plans, self.engines, strict=True):
            yield Member(plan["rank"], plan["node"], engine), plan

    @property
    def image(self) -> str:
        """The image every member runs, pinned by digest."""
        images = {plan["image"] for plan in self.plans}
        if len(images) != 1:
            raise DeployError(f"deployment {self.key[:16]}: members disagree on the image")
        return images.pop()

    @property
    def digest(self) -> str:
        """The image's digest."""
        return self.image.rsplit("@", 1)[1]

    def as_record(self) -> dict[str, Any]:
        """The deployment as kept in a record (enough to apply it again)."""
        return {"key": self.key, "plans": list(self.plans), "engines": list(self.engines)}

    @classmethod
    def from_record(cls, profile: str, record: dict[str, Any]) -> Deployment:
        """The deployment a record kept."""
        return cls(profile, record["key"], tuple(record["plans"]), tuple(record["engines"]))


def read_plans(folder: Path) -> tuple[dict[str, Any], ...]:
    """The launch plans a render step wrote, in rank order."""
    plans = []
    for path in sorted(folder.glob("launch-*.yaml")):
        with open(path) as f:
            plans.append(yaml.safe_load(f))
    if not plans:
        raise DeployError(f"{folder}: no launch plans (render wrote none)")
    return tuple(sorted(plans, key=lambda p: p["rank"]))
