"""The render stage as a keyed step: render, validate offline, and store only what passed."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from pipelines.core.paths import MANIFESTS_DIR, PROFILES_MODULE, RENDER_DIR
from pipelines.core.profiles import Profile
from pipelines.core.progress import say, show
from pipelines.core.schema import as_data
from pipelines.engine.stage import Context
from pipelines.engine.steps import Sources, Step, StepRun
from pipelines.stages.render.documents import Document, RenderInputs, write_documents
from pipelines.targets import load, renderer_for, target_of

if TYPE_CHECKING:
    from pipelines.engine.published import PublishedImage, PublishedModel

Renderer = Callable[[Profile, RenderInputs, list[str]], list[Document]]


def load_renderer(name: str) -> Renderer:
    """The renderer function a target names (imported when a render runs: the Kubernetes one
    brings the CRD schemas and CEL, not for `doit list`)."""
    renderer: Renderer = load(name)
    return renderer


class Render:
    """The render stage of one profile; publishes `step`, whose output folder is the manifests."""

    name = "render"

    def __init__(
        self,
        context: Context,
        *,
        model: PublishedModel,
        image: PublishedImage,
        stager: PublishedImage,
    ):
        profile = context.profile
        self.profile = profile
        self.engine = context.engine
        self.renderer = renderer_for(profile)
        self.target = target_of(profile)
        # A target that stages in the render (Kubernetes) stages a ring's weights member to
        # member in Jobs of the stager image, once its lock is complete: the plan needs every hash.
        staging = stager.wanted and self.target.stages_in_render and model.is_locked()
        self.step = self._step(
            model,
            image.ref,
            list(context.settings.secrets),
            image.tasks + (stager.tasks if staging else ()),
            stager.ref if staging else None,
        )

    def _step(
        self,
        model: PublishedModel,
        image: Callable[[], str],
        secrets: list[str],
        after: tuple[str, ...],
        stager_image: Callable[[], str] | None,
    ) -> Step:
        """The keyed render step: profile, image, lock, templates and patch code."""
        profile, renderer = self.profile, self.renderer

        def render(run: StepRun) -> None:
            lock = model.read_lock()
            plan = model.ring_plan_json() if run.params["stager_image"] else ""
            if not plan and self.target.stages_in_render and len(profile.members) > 1:
                show(
                    f"render: no ring staging Jobs until {model.lock_file.name} is complete"
                    " (`doit lock_weights`); the Model stages each member from S3"
                )
            inputs = RenderInputs(
                lock,
                run.params["image"],
                model.patch_source_text(),
                run.params["weights_root"],
                run.params["stager_image"],
                plan,
            )
            docs = load_renderer(renderer)(profile, inputs, secrets)
            write_documents(docs, run.out)
            say("render", f"{len(docs)} documents for {profile.name}:")
            for doc in docs:
                show(f"  {doc.file}")

        return Step(
            name="render",
            recipe="render",
            version=1,
            doc="render and validate the profile's manifests or launch plans, keyed by inputs",
            action=render,
            params=lambda: {
                "profile": as_data(profile),
                "image": image(),
                "weights_root": model.node_weights_root,
                "stager_image": stager_image() if stager_image else "",
            },
            inputs={
                "templates": MANIFESTS_DIR,
                "lock": model.lock_file,
                "patch": model.patch_source,
                # The code that turns the profile into documents: a change re-renders.
                "renderer": Sources(RENDER_DIR),
                "profile_model": PROFILES_MODULE,
            },
            after=after,
        )

    def create_doit_tasks(self) -> Iterator[dict[str, Any]]:
        """The render task."""
        yield self.engine.task(self.step, ("image_digest", "stager_digest"))
