"""The images stage as doit tasks: the local base and the runtime image as keyed engine steps
whose output lives in the registry, and the plan `doit plan` prints."""

from __future__ import annotations

import dataclasses
import json
import re
import time
from collections.abc import Iterator
from functools import cached_property
from typing import TYPE_CHECKING, Any

import msgspec

from pipelines.core.errors import PipelineError
from pipelines.core.progress import say, show
from pipelines.engine.published import PublishedImage
from pipelines.engine.stage import Context
from pipelines.engine.steps import Step, StepRun, side_task
from pipelines.stages.images.attest import Attester, utc_now
from pipelines.stages.images.inputs import base_repository, image_repository, repository_on
from pipelines.stages.images.promote import StableTag
from pipelines.stages.images.registry import Registry
from pipelines.stages.images.registry_cache import RegistryCache
from pipelines.stages.images.spec import (
    ImageBadInput,
    ImageDir,
    LocalBase,
    load_image,
)

if TYPE_CHECKING:
    from pipelines.stages.images.build import BuildPlan


# What `platform=` may name ("": image.yaml's platform).
PLATFORMS = ("", "linux/amd64", "linux/arm64")
# The doit variables its tasks read (besides profile).
PLATFORM = ("platform",)


class Images:
    """The runtime image of one profile (or, by `stager`, a ring's weights-stager image): its
    base, plan, build and push.

    Publishes `published`: the image pinned by digest and the tasks that build it.
    """

    name = "images"

    def __init__(
        self,
        context: Context,
        *,
        image: str | None = None,
        prefix: str = "",
        digest_var: str = "image_digest",
        platform: str | None = None,
        wanted: bool = True,
    ):
        # image: another image than the profile's runtime (the ring's weights-stager), whose
        # tasks are named with prefix so that both images live in one task graph.
        self.profile = context.profile
        self.engine = context.engine
        self.site = context.site
        self.builder = context.settings.builder  # SPARKFORGE_BUILDER: engine or buildx, or None
        self.buildx_cache = context.settings.buildx_cache  # SPARKFORGE_BUILDX_CACHE, or None
        self.image_name = image or context.profile.image
        self.prefix = prefix
        self.name = f"{prefix}images"  # the stage's name in the task table
        self.digest_var = digest_var  # the doit variable that passes a digest CI pushed
        self.given_digest = context.variable(digest_var)
        # Build for this platform, whatever image.yaml says: the runtime's for a ring's stager,
        # or `platform=linux/arm64` on the command line (under emulation on another machine).
        self.platform_override = platform or context.variable("platform")
        self.wanted = wanted
        self.settings, self.who, self.git = context.settings, context.who, context.git
        site = context.site
        self.registry = Registry(lambda: site.registry)
        self.namespace = site.namespace
        # `:stable` of the image's repository: what deploy moves (deploy's Tags).
        self.tags = StableTag(self.registry, self.repository)
        self.attester = Attester(context, self.engine.store)
        local = self.image.spec.base.local
        self.base_step = self._base_step(local) if local else None
        self.image_step = self._image_step()

    @classmethod
    def stager(cls, context: Context, *, runtime: Images) -> Images:
        """A ring's weights-stager image, for the runtime's platform; no tasks for one member."""
        return cls(
            context,
            image=context.profile.staging.image,
            prefix="stager_",
            digest_var="stager_digest",
            platform=runtime.platform,
            wanted=len(context.profile.members) > 1,
        )

    @property
    def published(self) -> PublishedImage:
        """The image pinned by digest, and the tasks to run first (none for a given digest)."""
        return PublishedImage(
            ref=lambda: self.image_ref(self.given_digest),
            tasks=() if self.given_digest or not self.wanted else (self.image_step.name,),
            wanted=self.wanted,
        )

    @cached_property
    def image(self) -> ImageDir:
        """The image folder, validated (its platform the one asked for, if any)."""
        image = load_image(self.image_name)
        if self.platform_override not in PLATFORMS:
            expected = " or ".join(p for p in PLATFORMS if p)
            raise ImageBadInput(f"platform={self.platform_override!r}: expected {expected}")
        if self.platform_override:
            spec = msgspec.structs.replace(image.spec, platform=self.platform_override)
            return dataclasses.replace(image, spec=spec)
        return image

    @property
    def platform(self) -> str | None:
        """The platform image.yaml names; None for native (this machine's)."""
        platform = self.image.spec.platform
        return None if platform == "native" else platform

    @property
    def arch(self) -> str:
        """The Debian architecture the image is built for (its base's too)."""
        from pipelines.stages.images.inputs import image_platform, platform_arch

        return platform_arch(image_platform(self.image))

    # --- base ------------------------------------------------------------------------------

    def _base_step(self, local: LocalBase) -> Step:
        """The keyed step that debootstraps the local base; its output is a registry tag."""
        from pipelines.stages.images.debian_lock import lock_file
        from pipelines.stages.images.inputs import BASE_RECIPE_VERSION, base_params

        repository = base_repository(local)
        lock = lock_file(self.image.base_folder)

        def debootstrap_base(run: StepRun) -> None:
            from pipelines.stages.images.base import build_base
            from pipelines.stages.images.oci import save_image_index

            epoch, debs = self.image.spec.source_date_epoch, self.engine.store.area("debs")
            image = build_base(local, lock, self.arch, epoch, run.out, debs)
            save_image_index(image, run.out)

        return Step(
            name=f"{self.prefix}image_base",
            recipe="debootstrap-base",
            version=BASE_RECIPE_VERSION,
            doc="debootstrap the local Debian base from its lock's .debs, push it under its key",
            action=debootstrap_base,
            params=lambda: base_params(local, self.arch, self.image.spec.source_date_epoch),
            inputs={"debian_lock": lock},
            cache=RegistryCache(self.registry, repository),
        )

    def lock_base(self) -> None:
        """Resolve the base's packages on its mirror today and write the lock; say what moved."""
        from pipelines.stages.images.debian_archive import lock_suite
        from pipelines.stages.images.debian_lock import (
            load_debian_lock,
            lock_changes,
            lock_file,
            release_change,
            write_debian_lock,
        )

        local, arch = self.image.spec.base.local, self.arch
        assert local is not None  # the task exists only for a local base
        path = lock_file(self.image.base_folder)
        old = load_debian_lock(path) if path.exists() else None
        # Every architecture locked before, and this one: one Release for all of them.
        new = lock_suite(local, [arch, *(old.archs if old else ())])
        write_debian_lock(new, path)
        name = f"{self.prefix}lock_base"
        release = release_change(old, new)
        say(name, f"{self.image_name}: {release or 'Release unchanged'}")
        for locked in sorted(new.archs):
            for line in lock_changes(old, new, locked) or ["no package moved"]:
                say(name, f"{self.image_name} {locked}: {line}")
        counts = ", ".join(f"{len(debs)} .debs for {a}" for a, debs in sorted(new.archs.items()))
        say(name, f"wrote {path} ({counts})")

    def base_ref(self) -> str:
        """The pinned reference of the image's base (a local base must be built first)."""
        spec = self.image.spec
        if spec.base.image:
            return spec.base.image
        step, local = self.base_step, spec.base.local
        assert step is not None and local is not None  # a base is pinned or local (spec.Base)
        repository = base_repository(local)
        tag = RegistryCache.key_tag(self.engine.key(step))
        digest = self.registry.manifest_digest(repository, tag)
        if digest is None:
            raise PipelineError(
                f"local base {repository}:{tag} is not built yet: run `doit {step.name}`"
            )
        return f"{self.registry.host}/{repository}@{digest}"

    # --- image -----------------------------------------------------------------------------

    def _image_step(self) -> Step:
        """The keyed image step: Dockerfile, context, args, platform; the base as a pin."""
        from pipelines.stages.images.inputs import candidate_tags, image_inputs, image_params
        from pipelines.stages.images.layer_format import NORMALIZER_VERSION

        repository = image_repository(self.image.spec.name, self.namespace)
        return Step(
            name=f"{self.prefix}image",
            recipe="image",
            version=NORMALIZER_VERSION,
            doc=f"build the {self.image_name} image once per input key, push it by digest",
            action=self._build,
            params=lambda: image_params(self.image),
            inputs=image_inputs(self.image),
            pins=lambda: {"base": self.base_ref().rsplit("@", 1)[1]},
            cache=RegistryCache(
                self.registry,
                repository,
                candidate_tags,
                attest=self.attester.attest(),
                # A push mounts the base's layers from its repository, not sending them again.
                mount_from=lambda: repository_on(self.base_ref(), self.registry.host),
            ),
            after=(self.base_step.name,) if self.base_step else (),
        )

    def attestation_of(self, ref: str) -> bytes | None:
        """The envelope attached to the image ref (registry/repository@digest), or None."""
        from pipelines.stages.images.attestations import find_attestation

        return find_attestation(self.registry, self.repository(), ref.rpartition("@")[2])

    def current_key(self) -> str:
        """The image's inputs key as this checkout computes it now (what `doit plan` prints)."""
        return self.engine.key(self.image_step)

    def plan(self) -> BuildPlan:
        """The build plan of the profile's image (its key from the engine)."""
        from pipelines.stages.images.build import plan_image

        step = self.image_step
        return plan_image(
            self.image,
            self.registry.host,
            self.base_ref(),
            self.engine.key(step),
            self.engine.material(step),
            self.namespace,
            self.buildx_cache,
        )

    def _build(self, run: StepRun) -> None:
        """Build and normalize the image into the step's folder; the registry cache pushes it."""
        from pipelines.stages.images.build import build_image, choose_builder, engine_client
        from pipelines.stages.images.layer_cache import LayerCache

        plan = self.plan()
        docker_host = self.site.docker_host
        builder = choose_builder(docker_host is not None, self.builder)
        if builder == "engine" and docker_host is None:
            raise PipelineError(
                f"profile {self.profile.name}: no engine and no buildx here; images for"
                f" {plan.platform} are built by CI (`doit plan` prints the invocation)"
            )
        client = engine_client(docker_host) if builder == "engine" else None
        layers = LayerCache(self.engine.store, self.engine.remote)
        # A start line before the silent part: a build of a GB10 image takes hours.
        say("image", f"building {plan.name} with {builder}, key {plan.key[:16]}")
        started, began = time.monotonic(), utc_now()
        build_image(client, plan, builder, run.out, layers)
        took = time.monotonic() - started
        self.attester.built_at = (began, utc_now())
        say("image", f"built with {builder}, key {plan.key[:16]}, in {took:.0f} s")

    def image_ref(self, digest: str = "") -> str:
        """The image pinned by digest: the one given, or the registry's for the current key."""
        repository = image_repository(self.image.spec.name, self.namespace)
        repo = f"{self.registry.host}/{repository}"
        if digest:
            if not re.fullmatch(r"sha256:[0-9a-f]{64}", digest):
                raise ImageBadInput(f"{self.digest_var}={digest!r}: expected sha256:<64 hex>")
            return f"{repo}@{digest}"
        key = self.engine.key(self.image_step)
        found = self.registry.manifest_digest(repository, RegistryCache.key_tag(key))
        if found is None:
            raise PipelineError(
                f"no image in {repo} for key {key[:16]}: build it (`doit {self.image_step.name}`)"
                f" or pass {self.digest_var}=sha256:... (the digest CI pushed)"
            )
        return f"{repo}@{found}"

    def repository(self) -> str:
        """The image's registry repository (without the host)."""
        return image_repository(self.image.spec.name, self.namespace)

    def print_plan(self) -> None:
        """Print what building the image means: key, base, args, the exact invocation."""
        from pipelines.stages.images.build import describe_plan

        show(json.dumps(describe_plan(self.plan(), RegistryCache.key_tag), indent=2))

    # --- doit tasks ------------------------------------------------------------------------

    def create_doit_tasks(self) -> Iterator[dict[str, Any]] | None:
        """The doit task dicts of the images stage for this profile (none for an unwanted one)."""
        return self._tasks() if self.wanted else None

    def _tasks(self) -> Iterator[dict[str, Any]]:
        """The base (when built here), the image and the plan tasks."""
        tasks = []
        if self.base_step:
            tasks.append(self.engine.task(self.base_step, PLATFORM))
            tasks.append(
                side_task(
                    f"{self.prefix}lock_base",
                    "lock the local base's Debian archive (Release, every .deb by sha256);"
                    " says what moved",
                    self.lock_base,
                    variables=PLATFORM,
                )
            )
        tasks.append(self.engine.task(self.image_step, PLATFORM))
        tasks.append(
            side_task(
                f"{self.prefix}plan",
                "print the image's key, base, build args and exact build invocation",
                self.print_plan,
                deps=list(self.image_step.after),
                variables=PLATFORM,
            )
        )
        yield from tasks
