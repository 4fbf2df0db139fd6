"""The sparkforge task graph: `doit list` shows the stages; `doit build profile=NAME` runs them."""

import os
import sys

from doit import get_var

from pipelines import stack
from pipelines.errors import PipelineError
from pipelines.images.tasks import Images
from pipelines.manifests import render_step
from pipelines.profiles import load_profile, profile_step
from pipelines.steps import Engine
from pipelines.store import STORE_ENV, Store
from pipelines.weights.tasks import Weights

ENGINE = Engine(Store())
PROFILE_NAME = get_var("profile", "local")

try:
    PROFILE = load_profile(PROFILE_NAME)
except PipelineError as err:
    sys.exit(f"error: {err}")
if PROFILE.local_stack:
    stack.export_s3_environment()

DOIT_CONFIG = {"default_tasks": ["build"]}
if os.environ.get(STORE_ENV):
    DOIT_CONFIG["dep_file"] = str(ENGINE.store.root / "doit.sqlite3")

PROFILE_STEP = profile_step(PROFILE_NAME)
WEIGHTS = Weights(PROFILE, ENGINE)
IMAGES = Images(PROFILE, ENGINE)
IMAGE_DIGEST = get_var("image_digest", "")
# Rings get manifests (Kubernetes) or launch plans (Docker hosts); the local profile neither yet.
RENDERS = PROFILE.deploy == "kubernetes" or PROFILE.runtime == "sglang"


def task_profile():
    return ENGINE.task(PROFILE_STEP)


def task_weights():
    yield from WEIGHTS.tasks()


def task_images():
    yield from IMAGES.tasks()


def task_render():
    if RENDERS:
        step = render_step(PROFILE, lambda: IMAGES.image_ref(IMAGE_DIGEST))
        task = ENGINE.task(step)
        task["task_dep"] = [] if IMAGE_DIGEST else ["image"]
        return task
    return None


def task_build():
    """build everything the chosen profile deploys (profile=NAME, default local)"""
    deps = [PROFILE_STEP.name, "image", "stage_weights"]
    if RENDERS:
        deps.append("render")
    return {"actions": None, "task_dep": deps}
