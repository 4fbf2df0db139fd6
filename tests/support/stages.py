"""Stages as dodo.py makes them, for tests: one Context, and what earlier stages publish."""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Iterable
from pathlib import Path

import msgspec

from pipelines.core.profiles import Profile, load_profile
from pipelines.core.settings import read_settings
from pipelines.core.site import Site
from pipelines.engine.published import PublishedImage
from pipelines.engine.stage import Context
from pipelines.engine.steps import Engine
from pipelines.stages.images import Images
from pipelines.stages.images.spec import load_image
from pipelines.stages.render import Render
from pipelines.stages.weights import Weights

# A site with no registry or engine to reach (a test that renders, or replays a launcher).
NO_SITE = Site(lambda: ("", ()))
# The stager image of a profile that stages no ring.
NO_STAGER = PublishedImage(lambda: "", (), wanted=False)


def context(
    profile: Profile,
    engine: Engine,
    site: Site = NO_SITE,
    secrets: Iterable[str] = (),
    **variables: str,
) -> Context:
    """A run's context: the defaults of an empty environment, the secrets and doit arguments
    given (the weights under the engine's store, as dodo.py puts them)."""
    settings = dataclasses.replace(read_settings({}), secrets=tuple(secrets))
    return Context(profile, engine, settings, site, variables, "tester", lambda: "abc123")


def pinned(image: str) -> PublishedImage:
    """An image given by reference (as `image_digest=` gives it): nothing to build first."""
    return PublishedImage(lambda: image, ())


def render_stage(
    profile: Profile, engine: Engine, image: str, secrets: Iterable[str] = ()
) -> Render:
    """The render stage of a profile around an image: the weights' published outputs."""
    run = context(profile, engine, secrets=secrets)
    weights = Weights(run)
    return Render(run, model=weights.outputs, image=pinned(image), stager=NO_STAGER)


class ImageAt(Images):
    """The images stage of the local profile around the image in a folder, for a platform."""

    def __init__(self, folder: Path, platform: str, engine: Engine, site: Site):
        image = load_image(folder.name, folder.parent)
        spec = msgspec.structs.replace(image.spec, platform=platform)
        self.image = dataclasses.replace(image, spec=spec)
        super().__init__(context(load_profile("local"), engine, site))


def image_copy(name: str, images: Path) -> Path:
    """A copy of images/<name> in images (a folder of image folders) to edit, beside a copy of
    the image whose base it shares (`base: same_as`), which load_image reads from there."""
    from pipelines.core.paths import IMAGES_DIR

    shared = load_image(name).shares_base_of
    for folder in [IMAGES_DIR / name, *([shared] if shared else [])]:
        shutil.copytree(folder, images / folder.name, ignore=shutil.ignore_patterns("__py*"))
    return images / name
