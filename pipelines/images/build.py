"""Image plans (pure: key, args, invocation) and building one through the Docker engine."""

from __future__ import annotations

import os
import platform as host_platform
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import docker
import docker.errors

from pipelines.images.context import context_digest, context_tar
from pipelines.images.dockerfile import check_contents, check_froms, upstream_arg
from pipelines.images.oci import NORMALIZER_VERSION, Image, LayerCache, normalize_saved_image
from pipelines.images.registry import Registry
from pipelines.images.spec import IMAGES_DIR, ImageDir, ImageError
from pipelines.keys import key_material, step_key
from pipelines.statcache import StatCache
from pipelines.store import REPO_ROOT

RECEIPT = IMAGES_DIR / "receipt.py"
EXTRA_CONTEXT = {"sparkforge-receipt.py": RECEIPT}  # every image carries the receipt writer
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
    material: dict = field(repr=False, default_factory=dict)

    @property
    def key_tag(self) -> str:
        """The tag that marks the image of this key in the registry (the image cache)."""
        return f"key-{self.key[:32]}"

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
    return command + ["--output", f"type=docker,dest={dest},rewrite-timestamp=true", str(context)]


def native_platform() -> str:
    """linux/<arch> of this machine, in OCI's names."""
    machine = host_platform.machine()
    return "linux/" + {"x86_64": "amd64", "aarch64": "arm64"}.get(machine, machine)


def digest_of(ref: str) -> str:
    """The sha256:... part of a pinned reference."""
    return ref.rsplit("@", 1)[1]


def plan_image(
    image: ImageDir, registry: str, base: str, statcache: StatCache, namespace: str = ""
) -> BuildPlan:
    """Check the image statically and compute its key; no engine, no network.

    registry is a host[:port]; namespace the path in front of sparkforge/<name> there.
    """
    spec = image.spec
    build_args = {"BASE": base, **spec.build_args}
    for name, upstream in spec.upstream.items():
        build_args[upstream_arg(name)] = upstream.commit
    text = image.dockerfile.read_text()
    check_froms(image.dockerfile, text, build_args)
    check_contents(image.dockerfile, text, spec)
    platform = native_platform() if spec.platform == "native" else spec.platform
    # The base enters the key by digest only: the same base from another registry is the same.
    keyed_args = {k: v for k, v in build_args.items() if k != "BASE"}
    material = key_material(
        "image",
        NORMALIZER_VERSION,
        {
            "name": spec.name,
            "platform": platform,
            "build_args": keyed_args,
            "source_date_epoch": spec.source_date_epoch,
            "upstream": {k: v.model_dump() for k, v in spec.upstream.items()},
        },
        {
            "dockerfile": statcache.digest_file(image.dockerfile),
            "context": context_digest(image.path, statcache, EXTRA_CONTEXT),
        },
        {"base": digest_of(base)},
    )
    return BuildPlan(
        name=spec.name,
        registry=registry,
        repository="/".join(part for part in (namespace, "sparkforge", spec.name) if part),
        platform=platform,
        base=base,
        build_args=build_args,
        epoch=spec.source_date_epoch,
        key=step_key(material),
        context=image.path,
        material=material,
    )


def git_revision() -> str:
    """The checkout's commit (what `candidate-<gitsha>` names), or 'unknown'."""
    result = subprocess.run(
        ["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True
    )
    return result.stdout.strip() if result.returncode == 0 else "unknown"


def engine_build(client: docker.DockerClient, plan: BuildPlan, saved: Path) -> None:
    """Build with the engine (context sent with normalized mtimes) and save the image tar."""
    tag = f"sparkforge-build/{plan.name}:{plan.key[:16]}"
    log: list[str] = []
    step = "(before the first step)"
    kwargs = {} if plan.platform == native_platform() else {"platform": plan.platform}
    try:
        stream = client.api.build(
            fileobj=context_tar(plan.context, plan.epoch, EXTRA_CONTEXT),
            custom_context=True,
            tag=tag,
            buildargs=plan.args_with_key(),
            rm=True,
            forcerm=True,
            network_mode="host",
            decode=True,
            **kwargs,
        )
        for chunk in stream:
            for line in chunk.get("stream", "").splitlines():
                log.append(line)
                if line.startswith("Step "):
                    step = line
            if "error" in chunk:
                tail = " | ".join(line for line in log[-LOG_TAIL:] if line.strip())
                error = chunk["error"].strip()
                raise ImageError(f"{plan.name}: build failed at {step}: {error}; log tail: {tail}")
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


def buildx_build(client: docker.DockerClient | None, plan: BuildPlan, saved: Path) -> None:
    """Build with buildx from the normalized context (SOURCE_DATE_EPOCH, rewritten timestamps)."""
    with tempfile.TemporaryDirectory(dir=saved.parent, prefix="context-") as context:
        with tarfile.open(fileobj=context_tar(plan.context, plan.epoch, EXTRA_CONTEXT)) as tar:
            tar.extractall(context, filter="data")
        result = subprocess.run(
            buildx_command(plan, Path(context), str(saved)),
            env={**os.environ, "SOURCE_DATE_EPOCH": str(plan.epoch)},
            capture_output=True,
            text=True,
        )
    if result.returncode != 0:
        tail = " | ".join((result.stdout + result.stderr).strip().splitlines()[-LOG_TAIL:])
        raise ImageError(f"{plan.name}: buildx failed (exit {result.returncode}): {tail}")


# Builders by name, each (client, plan, saved tar) -> None; the normalizer takes it from there.
BUILDERS = {"engine": engine_build, "buildx": buildx_build}


def choose_builder(has_engine: bool) -> str:
    """$SPARKFORGE_BUILDER if set; else the engine when there is one (the local stack), else
    buildx when present."""
    chosen = os.environ.get("SPARKFORGE_BUILDER") or (
        "engine" if has_engine or not buildx_available() else "buildx"
    )
    if chosen not in BUILDERS:
        raise ImageError(f"SPARKFORGE_BUILDER={chosen!r}: expected one of {', '.join(BUILDERS)}")
    return chosen


def build_and_push(
    client: docker.DockerClient,
    registry: Registry,
    plan: BuildPlan,
    work: Path | None = None,
    layers_cache: LayerCache | None = None,
    builder: str = "engine",
) -> tuple[str, bool]:
    """The image of the plan in the registry: (digest, built). Built only if its key is absent."""
    existing = registry.manifest_digest(plan.repository, plan.key_tag)
    if existing:
        return existing, False
    with tempfile.TemporaryDirectory(dir=work, prefix="image-") as tmp:
        saved = Path(tmp) / "saved.tar"
        BUILDERS[builder](client, plan, saved)
        image: Image = normalize_saved_image(saved, plan.epoch, Path(tmp), layers_cache)
        saved.unlink()
        digest = registry.push_image(
            plan.repository, image, [plan.key_tag, f"candidate-{git_revision()}"]
        )
    return digest, True
