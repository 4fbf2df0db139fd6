"""Image plans (pure: key, args, invocation) and building one through the Docker engine."""

from __future__ import annotations

import os
import subprocess
import tarfile
import tempfile
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipelines.stages.images.context import context_tar
from pipelines.stages.images.dockerfile import check_contents, check_froms

if TYPE_CHECKING:
    from docker import DockerClient
from pipelines.core.progress import say
from pipelines.stages.images.emulation import require_emulation
from pipelines.stages.images.inputs import (
    context_extra,
    debian_arch,
    image_build_args,
    image_platform,
    image_repository,
    native_platform,
    platform_arch,
)
from pipelines.stages.images.oci import (
    Image,
    Layers,
    extract_tar,
    normalize_saved_image,
    save_image_index,
)
from pipelines.stages.images.spec import ImageDir, ImageError, ImageUnreachable

LOG_TAIL = 15


@dataclass(frozen=True)
class BuildPlan:
    """Everything that decides an image, its key, and where it goes."""

    name: str
    registry: str
    repository: str
    platform: str
    base: str
    build_args: dict[str, str]
    epoch: int
    key: str
    context: Path
    material: dict[str, Any] = field(repr=False, default_factory=dict)
    extra: dict[str, Path] = field(default_factory=dict)  # context name -> file, beside context
    wheels: tuple[Path, str] | None = None  # (requirements file, Python version) to download
    cache: str | None = None  # buildx's registry cache (SPARKFORGE_BUILDX_CACHE): speed, not bytes

    def args_with_key(self) -> dict[str, str]:
        """Build args as passed to the builder: the plan's, plus the key for the receipt."""
        return {**self.build_args, "SPARKFORGE_IMAGE_KEY": self.key}

    def invocation(self) -> list[str]:
        """The exact buildx command (what CI runs on arm64 runners), before normalization."""
        context = Path("CONTEXT")  # the folder plus the receipt writer, mtimes and modes fixed
        return ["env", f"SOURCE_DATE_EPOCH={self.epoch}", *buildx_command(self, context)]


def buildx_command(plan: BuildPlan, context: Path, dest: str = "image.tar") -> list[str]:
    """`docker buildx build` of a plan into a docker-format tar (what the normalizer reads)."""
    command = ["docker", "buildx", "build", "--platform", plan.platform, "--network=host"]
    for name, value in sorted(plan.args_with_key().items()):
        command += ["--build-arg", f"{name}={value}"]
    command += ["--progress=plain"]  # lines as they come, on a terminal too: one log to read
    if plan.cache:  # the layers of earlier runs: only what changed is built again
        command += ["--cache-from", f"type=registry,ref={plan.cache}"]
        command += ["--cache-to", f"type=registry,ref={plan.cache},mode=max,image-manifest=true"]
    return command + ["--output", f"type=docker,dest={dest},rewrite-timestamp=true", str(context)]


def plan_image(
    image: ImageDir,
    registry: str,
    base: str,
    key: str,
    material: dict[str, Any],
    namespace: str = "",
    cache: str | None = None,
) -> BuildPlan:
    """Check the image statically and describe its build; no engine, no network.

    registry is a host[:port]; namespace the path in front of sparkforge/<name> there; key
    and material come from the engine's image step.
    """
    spec = image.spec
    build_args = image_build_args(image, base)
    text = image.dockerfile.read_text()
    check_froms(image.dockerfile, text, build_args)
    check_contents(image.dockerfile, text, spec)
    return BuildPlan(
        name=spec.name,
        registry=registry,
        repository=image_repository(spec.name, namespace),
        platform=image_platform(image),
        base=base,
        build_args=build_args,
        epoch=spec.source_date_epoch,
        key=key,
        context=image.path,
        material=material,
        extra=context_extra(image),
        wheels=(image.path / spec.wheels.requirements, spec.wheels.python) if spec.wheels else None,
        cache=cache,
    )


def full_context(plan: BuildPlan, scratch: Path) -> dict[str, Path]:
    """The plan's extra context files, plus its wheels downloaded into scratch."""
    if plan.wheels is None:
        return plan.extra
    from pipelines.stages.images.wheels import download_wheels

    requirements, python = plan.wheels
    return {**plan.extra, **download_wheels(requirements, plan.platform, python, scratch)}


def engine_build(client: DockerClient | None, plan: BuildPlan, saved: Path) -> None:
    """Build with the engine (context sent with normalized mtimes) and save the image tar."""
    import docker.errors  # the client is a docker SDK client: the package is loaded already

    assert client is not None  # the engine builder is chosen only where an engine answers

    # Unique per build: two builders of one key on one engine (two runners, two test runs)
    # must not remove each other's tag between build and save.
    tag = f"sparkforge-build/{plan.name}:{plan.key[:16]}-{uuid.uuid4().hex[:8]}"
    log: list[str] = []
    step = "(before the first step)"
    # None: the engine's own platform (the SDK sends no platform then).
    platform = None if plan.platform == native_platform() else plan.platform
    try:
        with tempfile.TemporaryDirectory(dir=saved.parent, prefix="wheels-") as scratch:
            context = context_tar(plan.context, plan.epoch, full_context(plan, Path(scratch)))
        stream = client.api.build(
            fileobj=context,
            custom_context=True,
            tag=tag,
            buildargs=plan.args_with_key(),
            rm=True,
            forcerm=True,
            # The tag's removal below prunes the build's intermediate images; a second build on
            # this engine that took them as its cache would lose its parent mid-build ("failed
            # to get digest"). Without the cache builds share nothing; after the prune there is
            # no cache for a later build anyway.
            nocache=True,
            network_mode="host",
            decode=True,
            platform=platform,
        )
        for chunk in stream:
            for line in chunk.get("stream", "").splitlines():
                log.append(line)
                if line.startswith("Step "):
                    step = line
                if line.strip():  # as it comes: hours of kernel builds are not silent
                    say(f"image {plan.name}", line)
            if "error" in chunk:
                tail = " | ".join(line for line in log[-LOG_TAIL:] if line.strip())
                error = chunk["error"].strip()
                raise ImageError(f"{plan.name}: build failed at {step}: {error}; log tail: {tail}")
        say(f"image {plan.name}", "built; saving it from the engine")
        with open(saved, "wb") as out:
            for part in client.api.get_image(tag):
                out.write(part)
        client.api.remove_image(tag, noprune=False)
    except docker.errors.DockerException as err:
        raise ImageError(f"{plan.name}: Docker engine: {err}") from None


def buildx_available() -> bool:
    """True when `docker buildx` answers (GitHub's runners have it; these machines do not)."""
    try:
        return subprocess.run(["docker", "buildx", "version"], capture_output=True).returncode == 0
    except FileNotFoundError:
        return False


def buildx_build(client: DockerClient | None, plan: BuildPlan, saved: Path) -> None:
    """Build with buildx from the normalized context (SOURCE_DATE_EPOCH, rewritten timestamps)."""
    with tempfile.TemporaryDirectory(dir=saved.parent, prefix="context-") as tmp:
        context = Path(tmp) / "context"
        extra = full_context(plan, Path(tmp) / "wheels")
        with tarfile.open(fileobj=context_tar(plan.context, plan.epoch, extra)) as tar:
            extract_tar(tar, context, "data")
        log: deque[str] = deque(maxlen=LOG_TAIL)
        with subprocess.Popen(
            buildx_command(plan, context, str(saved)),
            env={**os.environ, "SOURCE_DATE_EPOCH": str(plan.epoch)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        ) as builder:
            assert builder.stdout is not None  # a pipe, asked for above
            for line in builder.stdout:  # as it comes, and its tail kept for the error
                if line.strip():
                    log.append(line.rstrip())
                    say(f"image {plan.name}", line.rstrip())
        status = builder.wait()
    if status != 0:
        raise ImageError(f"{plan.name}: buildx failed (exit {status}): {' | '.join(log)}")


# Builders by name, each (client, plan, saved tar) -> None; the normalizer takes it from there.
BUILDERS = {"engine": engine_build, "buildx": buildx_build}


def engine_client(docker_host: str | None) -> DockerClient:
    """A Docker SDK client for the engine the edge named."""
    import docker
    import docker.errors

    try:
        return docker.DockerClient(base_url=docker_host)
    except docker.errors.DockerException as err:
        raise ImageUnreachable(f"Docker engine {docker_host}: {err}") from None


def choose_builder(has_engine: bool, asked: str | None = None) -> str:
    """The builder asked for (SPARKFORGE_BUILDER); else the engine when there is one (the local
    stack), else buildx when present."""
    chosen = asked or ("engine" if has_engine or not buildx_available() else "buildx")
    if chosen not in BUILDERS:
        raise ImageError(f"SPARKFORGE_BUILDER={chosen!r}: expected one of {', '.join(BUILDERS)}")
    return chosen


def build_image(
    client: DockerClient | None,
    plan: BuildPlan,
    builder: str,
    out: Path,
    layers_cache: Layers | None = None,
) -> Image:
    """Build the plan with a builder and normalize the result into out (blobs + image.json)."""
    require_emulation(platform_arch(plan.platform), debian_arch())
    with tempfile.TemporaryDirectory(dir=out, prefix="build-") as tmp:
        saved = Path(tmp) / "saved.tar"
        BUILDERS[builder](client, plan, saved)
        image = normalize_saved_image(saved, plan.epoch, out, layers_cache)
    save_image_index(image, out)
    return image


def describe_plan(plan: BuildPlan, key_tag: Callable[[str], str]) -> dict[str, Any]:
    """What building the image means, as `doit plan` prints it: key, base, args, invocation."""
    return {
        "image": plan.name,
        "key": plan.key,
        "repository": f"{plan.registry}/{plan.repository}",
        "tags": [key_tag(plan.key), "candidate-<gitsha>"],
        "platform": plan.platform,
        "base": plan.base,
        "build_args": plan.build_args,
        "invocation": plan.invocation(),
        "CONTEXT": {
            "folder": str(plan.context),
            "extra": {k: str(v) for k, v in plan.extra.items()},
            "wheels": str(plan.wheels[0]) if plan.wheels else None,
            "normalized": "sorted, mtime SOURCE_DATE_EPOCH, owner 0, mode 644/755",
        },
        "key_material": plan.material,
    }
