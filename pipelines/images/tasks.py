"""The images stage as doit tasks: the local base, the profile's runtime image, and its plan."""

from __future__ import annotations

import json
import re
import tempfile
from functools import cached_property
from pathlib import Path
from typing import Any

from pipelines import stack
from pipelines.errors import PipelineError
from pipelines.images.base import base_key, base_repository, build_base, debian_arch
from pipelines.images.build import (
    EXTRA_CONTEXT,
    BuildPlan,
    build_and_push,
    choose_builder,
    plan_image,
)
from pipelines.images.oci import LayerCache
from pipelines.images.registry import Registry
from pipelines.images.spec import ImageDir, load_image
from pipelines.profiles import Profile
from pipelines.steps import Engine, side_task


class Images:
    """The runtime image of one profile: its base, plan, build and push."""

    def __init__(self, profile: Profile, engine: Engine):
        self.profile = profile
        self.engine = engine

    @cached_property
    def image(self) -> ImageDir:
        """The profile's image folder, validated."""
        return load_image(self.profile.image)

    @cached_property
    def registry(self) -> Registry:
        """The registry host images go to: the local stack's, or the profile's."""
        if self.profile.local_stack:
            return Registry(stack.read_endpoints().registry)
        return Registry(self.profile.registry.split("/", 1)[0])

    @property
    def namespace(self) -> str:
        """The path in the registry in front of sparkforge/<image> (the lab's namespace)."""
        if self.profile.local_stack or "/" not in self.profile.registry:
            return ""
        return self.profile.registry.split("/", 1)[1]

    def base_tag(self) -> tuple[str, str]:
        """(repository, key tag) of the local base."""
        local = self.image.spec.base.local
        return base_repository(local), f"key-{base_key(local, debian_arch())[:32]}"

    def base_ref(self) -> str:
        """The pinned reference of the image's base (the local base must be built first)."""
        spec = self.image.spec
        if spec.base.image:
            return spec.base.image
        repo, tag = self.base_tag()
        digest = self.registry.manifest_digest(repo, tag)
        if digest is None:
            raise PipelineError(f"local base {repo}:{tag} is not built yet: run `doit image_base`")
        return f"{self.registry.host}/{repo}@{digest}"

    def plan(self) -> BuildPlan:
        """The build plan of the profile's image."""
        return plan_image(
            self.image,
            self.registry.host,
            self.base_ref(),
            self.engine.store.statcache,
            self.namespace,
        )

    def image_ref(self, digest: str = "") -> str:
        """The image pinned by digest: the one given, or the registry's for the current key."""
        plan = self.plan()
        repo = f"{self.registry.host}/{plan.repository}"
        if digest:
            if not re.fullmatch(r"sha256:[0-9a-f]{64}", digest):
                raise PipelineError(f"image_digest={digest!r}: expected sha256:<64 hex>")
            return f"{repo}@{digest}"
        found = self.registry.manifest_digest(plan.repository, plan.key_tag)
        if found is None:
            raise PipelineError(
                f"no image in {repo} for key {plan.key[:16]}: build it (`doit image`) or pass"
                " image_digest=sha256:... (the digest CI pushed)"
            )
        return f"{repo}@{found}"

    # --- base ------------------------------------------------------------------------------

    def base_built(self) -> bool:
        """True when the registry holds the local base of this key."""
        try:
            repo, tag = self.base_tag()
            return self.registry.manifest_digest(repo, tag) is not None
        except PipelineError:
            return False

    def build_base(self) -> None:
        """debootstrap the base, pack it and push it under its key."""
        repo, tag = self.base_tag()
        with tempfile.TemporaryDirectory(dir=self.engine.store.root / "tmp") as work:
            image = build_base(
                self.image.spec.base.local,
                debian_arch(),
                self.image.spec.source_date_epoch,
                Path(work),
            )
            digest = self.registry.push_image(repo, image, [tag])
        print(f"image_base: {self.registry.host}/{repo}@{digest}")

    # --- image -----------------------------------------------------------------------------

    def built(self) -> bool:
        """True when the registry holds the image of the current key (no build, no push)."""
        try:
            plan = self.plan()
            return self.registry.manifest_digest(plan.repository, plan.key_tag) is not None
        except PipelineError:
            return False

    def build(self) -> None:
        """Build, normalize and push the image unless its key is in the registry."""
        plan = self.plan()
        client = stack.docker_client(stack.read_endpoints()) if self.profile.local_stack else None
        builder = choose_builder(has_engine=client is not None)
        if client is None and builder == "engine":
            raise PipelineError(
                f"profile {self.profile.name}: no engine and no buildx here; images for"
                f" {plan.platform} are built by CI (`doit plan` prints the invocation)"
            )
        store = self.engine.store.root
        digest, built = build_and_push(
            client, self.registry, plan, store / "tmp", LayerCache(store / "layers"), builder
        )
        state = f"built with {builder} and pushed" if built else "already in the registry"
        print(
            f"image: {self.registry.host}/{plan.repository}@{digest} ({state}, key {plan.key[:16]})"
        )

    def print_plan(self) -> None:
        """Print what building the image means: key, base, args, the exact invocation."""
        plan = self.plan()
        print(
            json.dumps(
                {
                    "image": plan.name,
                    "key": plan.key,
                    "repository": f"{plan.registry}/{plan.repository}",
                    "tags": [plan.key_tag, "candidate-<gitsha>"],
                    "platform": plan.platform,
                    "base": plan.base,
                    "build_args": plan.build_args,
                    "invocation": plan.invocation(),
                    "CONTEXT": {
                        "folder": str(plan.context),
                        "extra": {k: str(v) for k, v in EXTRA_CONTEXT.items()},
                        "normalized": "sorted, mtime SOURCE_DATE_EPOCH, owner 0, mode 644/755",
                    },
                    "key_material": plan.material,
                },
                indent=2,
            )
        )

    # --- doit tasks ------------------------------------------------------------------------

    def tasks(self) -> list[dict[str, Any]]:
        """The doit task dicts of the images stage for this profile."""
        tasks = []
        deps = []
        if self.image.spec.base.local:
            tasks.append(
                side_task(
                    "image_base",
                    "debootstrap the local Debian base and push it under its key",
                    self.build_base,
                    uptodate=self.base_built,
                )
            )
            deps.append("image_base")
        tasks.append(
            side_task(
                "image",
                "build the profile's runtime image once per input key, push it by digest",
                self.build,
                uptodate=self.built,
                deps=deps,
            )
        )
        tasks.append(
            side_task(
                "plan",
                "print the image's key, base, build args and exact build invocation",
                self.print_plan,
                deps=list(deps),
            )
        )
        return tasks
