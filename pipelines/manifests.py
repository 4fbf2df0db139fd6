"""The render stage as a keyed step: render, validate offline, and store only what passed."""

from __future__ import annotations

import json
from collections.abc import Callable

from pipelines.launch import launch_plans
from pipelines.profiles import Profile
from pipelines.render import (
    PATCH_SOURCE,
    TEMPLATES,
    RenderError,
    kustomization,
    render_kubernetes,
    write_documents,
)
from pipelines.steps import Step, StepRun
from pipelines.validate import check_ring_rules, check_secrets, secret_values, validate_documents
from pipelines.weights.lock import cache_key, load_lock, lock_path


def render_profile(profile: Profile, image: str, secrets: list[str]):
    """The validated documents of a profile, or RenderError with one line per violation."""
    lock = load_lock(lock_path(profile.model.lock))
    if profile.deploy == "kubernetes":
        docs = render_kubernetes(profile, lock, image)
        violations = validate_documents(docs, secrets)
        docs.append(kustomization(docs))
    else:
        weights = f"{profile.node_weights_root}/models/{cache_key(lock.source)}"
        docs = launch_plans(profile, image, weights)
        violations = check_ring_rules(docs) + check_secrets(docs, secrets)
    if violations:
        raise RenderError("\n".join(violations))
    return docs


def render_step(profile: Profile, image: Callable[[], str]) -> Step:
    """The keyed render step: its key covers the profile, image, lock, templates and patch code.

    image is called when the key is needed: the digest comes from the image task of the run.
    """

    def render(run: StepRun) -> None:
        docs = render_profile(profile, run.params["image"], secret_values())
        write_documents(docs, run.out)
        print(f"render: {len(docs)} documents for {profile.name}:")
        for doc in docs:
            print(f"  {doc.file}")

    return Step(
        name="render",
        recipe="render",
        version=1,
        doc="render and validate the profile's manifests or launch plans, keyed by their inputs",
        action=render,
        params=lambda: {"profile": json.loads(profile.model_dump_json()), "image": image()},
        inputs={
            "templates": TEMPLATES,
            "lock": lock_path(profile.model.lock),
            "patch": PATCH_SOURCE,
        },
    )
