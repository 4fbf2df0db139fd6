"""The profile stage: the chosen profile, validated and stored as canonical JSON, keyed."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pipelines.core.paths import PROFILES_DIR, PROFILES_MODULE, SCHEMA_MODULE
from pipelines.core.profiles import load_profile, profile_path
from pipelines.core.schema import as_data
from pipelines.engine.keys import canonical_json
from pipelines.engine.stage import Context
from pipelines.engine.steps import Step, StepRun


def profile_step(name: str, folder: Path = PROFILES_DIR) -> Step:
    """The keyed step that validates a profile and stores it as canonical JSON for later steps."""

    def write_profile(run: StepRun) -> None:
        profile = load_profile(name, folder)
        (run.out / "profile.json").write_bytes(canonical_json(as_data(profile)))

    return Step(
        name="profile",
        recipe="profile",
        version=1,
        doc="validate the chosen profile and store it, keyed by its content",
        action=write_profile,
        params={"profile": name},
        # The schema's code too: its defaults are written into profile.json.
        inputs={
            "profile": profile_path(name, folder),
            "profile_model": PROFILES_MODULE,
            "schema": SCHEMA_MODULE,
        },
    )


class ProfileCheck:
    """The profile stage of the run's profile; publishes `step`."""

    name = "profile"

    def __init__(self, context: Context):
        self.engine = context.engine
        self.step = profile_step(context.profile.name, context.settings.profiles)

    def create_doit_tasks(self) -> Iterator[dict[str, Any]]:
        """The profile task."""
        yield self.engine.task(self.step)
