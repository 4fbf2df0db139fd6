"""A deployment: the rendered launch plans of a profile, under the key that rendered them."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipelines.core.errors import DeployError
from pipelines.core.files import MiB
from pipelines.core.schema import load_yaml_documents
from pipelines.targets.dockerengines import MemberHost

# A render writes a few KiB per document (the largest, a ConfigMap holding the patch program,
# some 20 KiB); a file past this is not one it wrote.
DOCUMENTS_MAX_BYTES = 16 * MiB


@dataclass(frozen=True)
class Deployment:
    """What one deploy applies: the rendered documents (launch plans by rank, or Kubernetes
    objects in apply order), the image they run and, on Docker hosts, each member's engine."""

    profile: str
    key: str  # the render step's key: same key, same deployment
    documents: tuple[dict[str, Any], ...]
    image: str  # pinned by digest
    engines: tuple[str, ...] = ()  # Docker hosts: the Docker URL of each member, by rank

    def members(self) -> Iterator[tuple[MemberHost, dict[str, Any]]]:
        """(member, launch plan) in rank order (Docker hosts)."""
        for plan, engine in zip(self.documents, self.engines, strict=True):
            yield MemberHost(plan["rank"], plan["node"], engine), plan

    @property
    def digest(self) -> str:
        """The image's digest."""
        return self.image.rsplit("@", 1)[1]

    def as_record(self) -> dict[str, Any]:
        """The deployment as kept in a record (enough to apply it again)."""
        return {
            "key": self.key,
            "documents": list(self.documents),
            "image": self.image,
            "engines": list(self.engines),
        }

    @classmethod
    def from_record(cls, profile: str, record: dict[str, Any]) -> Deployment:
        """The deployment a record kept."""
        return cls(
            profile,
            record["key"],
            tuple(record["documents"]),
            record["image"],
            tuple(record["engines"]),
        )


def read_documents(folder: Path, pattern: str = "*.yaml") -> list[tuple[str, dict[str, Any]]]:
    """(file name, body) of every YAML document a render step wrote, by file name."""
    found = []
    for path in sorted(folder.glob(pattern)):
        bodies = load_yaml_documents(path, DeployError, DOCUMENTS_MAX_BYTES)
        found += [(path.name, body) for body in bodies if body]
    if not found:
        raise DeployError(f"{folder}: no {pattern} documents (render wrote none)")
    return found


def one_image(images: set[str], key: str) -> str:
    """The single image a deployment's documents name, pinned by digest."""
    if len(images) != 1:
        raise DeployError(f"deployment {key[:16]}: expected one image, found {sorted(images)}")
    return images.pop()
