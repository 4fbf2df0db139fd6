"""`images/<name>/image.yaml`: what an image is built from and what it must contain."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import msgspec
from msgspec import Meta, field

from pipelines.core.errors import BadInput, PipelineError, Unreachable
from pipelines.core.paths import IMAGES_DIR, REPO_ROOT
from pipelines.core.schema import Strict, load_yaml_model

PINNED = re.compile(r"^[a-z0-9][a-z0-9._/:-]*@sha256:[0-9a-f]{64}$")
NAME = r"^[a-z0-9][a-z0-9.-]*$"  # an image's name, its folder's under images/
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
    """The FROM of an image: a registry image pinned by digest, a base made here, or the base
    made here for another image (one debootstrap, one lock and one key for both)."""

    image: Annotated[str, Meta(pattern=PINNED.pattern)] | None = None
    local: LocalBase | None = None
    same_as: Annotated[str, Meta(pattern=NAME)] | None = None

    def __post_init__(self) -> None:
        """A base is pinned, local or another image's local one: exactly one of them."""
        if [self.image, self.local, self.same_as].count(None) != 2:
            raise ValueError(
                "base needs exactly one of 'image' (pinned by digest), 'local' or 'same_as'"
                " (another image's local base)"
            )


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

    name: Annotated[str, Meta(pattern=NAME)]
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
    spec: ImageSpec  # a base `same_as` another image's is read as that image's `local`
    shares_base_of: Path | None = None  # that image's folder, for a base `same_as` it

    @property
    def base_folder(self) -> Path:
        """The folder whose Debian lock the local base is made from: the image's own, or that
        of the image whose base it shares."""
        return self.shares_base_of or self.path

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
    shares_base_of = None
    if spec.base.same_as is not None:
        spec, shares_base_of = shared_base(path / "image.yaml", spec, folder)
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
    return ImageDir(path, spec, shares_base_of)


def shared_base(image_yaml: Path, spec: ImageSpec, folder: Path) -> tuple[ImageSpec, Path]:
    """spec with the local base of the image its base is `same_as`, and that image's folder.
    The two must be dated alike: the date is in the base's key, and one base has one key."""
    other = str(spec.base.same_as)
    where, owner_folder = f"{image_yaml}: field 'base.same_as'", folder / other
    if other == spec.name or not (owner_folder / "image.yaml").is_file():
        images = ", ".join(i for i in available_images(folder) if i != spec.name)
        raise ImageError(f"{where}: expected another image of {folder} ({images}), got {other!r}")
    owner = load_yaml_model(owner_folder / "image.yaml", ImageSpec, ImageError)
    if owner.base.local is None:
        raise ImageError(
            f"{where}: expected an image whose base is made here (base.local), got {other!r}"
        )
    if owner.source_date_epoch != spec.source_date_epoch:
        raise ImageError(
            f"{image_yaml}: field 'source_date_epoch': expected {owner.source_date_epoch},"
            f" the date of {other}'s base, which this image shares (base.same_as), got"
            f" {spec.source_date_epoch}"
        )
    return msgspec.structs.replace(spec, base=Base(local=owner.base.local)), owner_folder


def available_images(folder: Path = IMAGES_DIR) -> list[str]:
    """Names of the image folders."""
    return sorted(p.name for p in folder.iterdir() if (p / "Dockerfile").is_file())
