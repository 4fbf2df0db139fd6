"""`images/<name>/image.yaml`: what an image is built from and what it must contain."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

from msgspec import Meta, field

from pipelines.core.errors import BadInput, PipelineError, Unreachable
from pipelines.core.paths import IMAGES_DIR, REPO_ROOT
from pipelines.core.schema import Strict, load_yaml_model

PINNED = re.compile(r"^[a-z0-9][a-z0-9._/:-]*@sha256:[0-9a-f]{64}$")
Commit = Annotated[str, Meta(pattern=r"^[0-9a-f]{7,40}$")]


class ImageError(PipelineError):
    """An image that cannot be planned, built or pushed."""


class ImageUnreachable(ImageError, Unreachable):
    """A registry or Docker engine that does not answer at all."""


class ImageBadInput(ImageError, BadInput):
    """An image digest or registry credentials given in a form that cannot be used."""


class LocalBase(Strict, frozen=True, kw_only=True):
    """A base made here from a Debian rootfs (debootstrap), itself a keyed step."""

    suite: str
    variant: Literal["minbase"] = "minbase"
    packages: list[str] = []
    mirror: str = "http://deb.debian.org/debian"


class Base(Strict, frozen=True, kw_only=True):
    """The FROM of an image: a registry image pinned by digest, or a base made here."""

    image: Annotated[str, Meta(pattern=PINNED.pattern)] | None = None
    local: LocalBase | None = None

    def __post_init__(self) -> None:
        """A base is either pinned or local, never both or neither."""
        if (self.image is None) == (self.local is None):
            raise ValueError("base needs exactly one of 'image' (pinned by digest) or 'local'")


class Upstream(Strict, frozen=True):
    """A source built into the image, pinned by commit."""

    repo: str
    commit: Commit


class Checks(Strict, frozen=True, kw_only=True):
    """What the built image (and its Dockerfile) must contain."""

    cuda_arch_list: str | None = None
    max_jobs: int | None = None
    receipt: str = "/opt/sparkforge/receipt.json"
    nccl: Literal["none", "pip", "sparkring-overlay"] = "none"


class Wheels(Strict, frozen=True, kw_only=True):
    """Python packages as locked wheels: a requirements file with hashes, for one Python."""

    requirements: str  # in the image folder
    python: Annotated[str, Meta(pattern=r"^3\.[0-9]+$")]


class ImageSpec(Strict, frozen=True, kw_only=True):
    """One image: name, platform, base, build args, pinned upstreams and checks."""

    name: Annotated[str, Meta(pattern=r"^[a-z0-9][a-z0-9.-]*$")]
    description: str
    platform: Literal["linux/arm64", "linux/amd64", "native"]
    base: Base
    build_args: dict[str, str] = {}
    upstream: dict[str, Upstream] = {}
    source_date_epoch: Annotated[int, Meta(ge=0)]
    checks: Checks = field(default_factory=Checks)
    project_files: list[str] = []  # the repository's files the context carries, same paths
    wheels: Wheels | None = None  # downloaded into the context's wheels/ at build time


@dataclass(frozen=True)
class ImageDir:
    """An image folder: its spec, Dockerfile and build context."""

    path: Path
    spec: ImageSpec

    @property
    def dockerfile(self) -> Path:
        """The Dockerfile."""
        return self.path / "Dockerfile"


def load_image(name: str, folder: Path = IMAGES_DIR) -> ImageDir:
    """The image folder of a name, its image.yaml validated."""
    path = folder / name
    if not (path / "Dockerfile").is_file():
        raise ImageError(f"{path}: no Dockerfile (images: {', '.join(available_images(folder))})")
    spec = load_yaml_model(path / "image.yaml", ImageSpec, ImageError)
    if spec.name != name:
        raise ImageError(
            f"{path / 'image.yaml'}: field 'name': expected {name!r}, got {spec.name!r}"
        )
    for index, rel in enumerate(spec.project_files):
        if not (REPO_ROOT / rel).is_file():
            raise ImageError(
                f"{path / 'image.yaml'}: field 'project_files[{index}]': {rel!r} is not a file"
                " of the repository"
            )
    if spec.wheels and not (path / spec.wheels.requirements).is_file():
        raise ImageError(
            f"{path / 'image.yaml'}: field 'wheels.requirements': no file"
            f" {spec.wheels.requirements!r} in {path}"
        )
    return ImageDir(path, spec)


def available_images(folder: Path = IMAGES_DIR) -> list[str]:
    """Names of the image folders."""
    return sorted(p.name for p in folder.iterdir() if (p / "Dockerfile").is_file())
