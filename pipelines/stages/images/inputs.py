"""What an image's key is made of: its parameters, input files and names, without building.

Kept apart from build and base so that defining the image steps (every `doit` start, `doit
list` too) imports no tar, gzip or engine code.
"""

from __future__ import annotations

import platform as host_platform
import subprocess
from pathlib import Path
from typing import Any

from pipelines.core.paths import RECEIPT, REPO_ROOT
from pipelines.core.schema import as_data
from pipelines.stages.images.context import BuildContext
from pipelines.stages.images.dockerfile import upstream_arg
from pipelines.stages.images.layer_format import layer_format
from pipelines.stages.images.spec import ImageDir, LocalBase

EXTRA_CONTEXT = {"sparkforge-receipt.py": RECEIPT}  # every image carries the receipt writer
# 2: built from the Debian lock's .debs; 3: dated SOURCE_DATE_EPOCH; 4: an environment of its own
BASE_RECIPE_VERSION = 4


def native_platform() -> str:
    """linux/<arch> of this machine, in OCI's names."""
    machine = host_platform.machine()
    return "linux/" + {"x86_64": "amd64", "aarch64": "arm64"}.get(machine, machine)


def platform_arch(platform: str) -> str:
    """The Debian architecture of an OCI platform (linux/arm64 -> arm64)."""
    return platform.rpartition("/")[2]


def image_build_args(image: ImageDir, base: str) -> dict[str, str]:
    """The build args of an image: its base, its own args, and each upstream's commit."""
    build_args = {"BASE": base, **image.spec.build_args}
    for name, upstream in image.spec.upstream.items():
        build_args[upstream_arg(name)] = upstream.commit
    return build_args


def image_platform(image: ImageDir) -> str:
    """The platform an image is built for (native: this machine's)."""
    return native_platform() if image.spec.platform == "native" else image.spec.platform


def image_params(image: ImageDir) -> dict[str, Any]:
    """The keyed parameters of an image; the base enters the key by digest, as a pin."""
    spec = image.spec
    return {
        "name": spec.name,
        "platform": image_platform(image),
        "build_args": {k: v for k, v in image_build_args(image, "").items() if k != "BASE"},
        "source_date_epoch": spec.source_date_epoch,
        "upstream": {k: as_data(v) for k, v in spec.upstream.items()},
        "layers": layer_format(),
    }


def context_extra(image: ImageDir) -> dict[str, Path]:
    """Context name -> file, besides the image folder: the receipt writer and the project files
    the image names (the wheels enter the key through their hashed requirements file)."""
    return {**EXTRA_CONTEXT, **{rel: REPO_ROOT / rel for rel in image.spec.project_files}}


def image_inputs(image: ImageDir) -> dict[str, Path | BuildContext]:
    """The files an image is built from: its Dockerfile and its context (receipt included)."""
    context = BuildContext(image.path, context_extra(image))
    return {"dockerfile": image.dockerfile, "context": context}


def image_repository(name: str, namespace: str = "") -> str:
    """The registry repository of an image: [namespace/]sparkforge/<name>."""
    return "/".join(part for part in (namespace, "sparkforge", name) if part)


def git_revision() -> str:
    """The checkout's commit (what `candidate-<gitsha>` names), or 'unknown'."""
    result = subprocess.run(
        ["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True
    )
    return result.stdout.strip() if result.returncode == 0 else "unknown"


def candidate_tags() -> tuple[str, ...]:
    """The tags CI's image carries beside its key tag: `candidate-<gitsha>`."""
    return (f"candidate-{git_revision()}",)


def debian_arch() -> str:
    """This machine's Debian architecture (amd64, arm64)."""
    known = {"x86_64": "amd64", "aarch64": "arm64"}.get(host_platform.machine())
    if known:
        return known  # what dpkg says on these two, without starting it on every run
    return subprocess.run(
        ["dpkg", "--print-architecture"], capture_output=True, text=True, check=True
    ).stdout.strip()


def base_params(spec: LocalBase, arch: str, epoch: int) -> dict[str, Any]:
    """The keyed parameters of a local base: suite, variant, packages, mirror, architecture,
    the date its build is given (SOURCE_DATE_EPOCH: shadow's days, .pyc stamps and the layer's
    mtimes are that day's) and what writes its layer."""
    return {**as_data(spec), "arch": arch, "source_date_epoch": epoch, "layers": layer_format()}


def base_repository(spec: LocalBase) -> str:
    """The registry repository of a local base."""
    return f"sparkforge/base-{spec.suite}"


def repository_on(ref: str, host: str) -> str | None:
    """The repository of a pinned reference (host/repository@digest) where host is its
    registry, else None (a name without a host is Docker Hub's)."""
    where, _, repository = ref.rpartition("@")[0].partition("/")
    return repository if where == host and repository else None
