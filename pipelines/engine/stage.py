"""The one shape of a stage: made from a Context plus what earlier stages publish, by keyword.

doit finds a stage's tasks through `create_doit_tasks` (doit's loader takes any object of the
dodo module that has it), so `dodo.py` is a table of stage objects. A stage with nothing to do
for a profile (the fabric check of a profile without a fabric section, the stager image of a
profile that stages no ring) yields no tasks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from pipelines.core.profiles import Profile
from pipelines.core.settings import Settings
from pipelines.core.site import Site
from pipelines.engine.steps import Engine


@dataclass(frozen=True)
class Context:
    """What every stage is made with: the profile, the engine, this run's settings and site."""

    profile: Profile
    engine: Engine
    settings: Settings
    site: Site
    # doit's name=value arguments of this run (image_digest=, stager_digest=, expect=).
    variables: Mapping[str, str] = field(default_factory=dict)
    who: str = "unknown"  # the CI run or user, for records
    git: Callable[[], str] = lambda: "unknown"  # the checkout's commit, asked when recording

    def variable(self, name: str) -> str:
        """A doit argument of this run, "" when not given."""
        return self.variables.get(name, "")


class Stage(Protocol):
    """A stage: a name for the table and the doit tasks it yields for the profile."""

    name: str

    def create_doit_tasks(self) -> Iterator[dict[str, Any]] | None:
        """The stage's doit task dicts; None when the profile gives it nothing to do (an empty
        generator would make doit list an empty group task named for the dodo variable)."""
        ...
