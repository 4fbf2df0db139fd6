"""What one stage publishes for the stages after it: the only shapes stages meet through.

dodo.py hands each stage these values; no stage imports another (an import-linter independence
contract holds it), so a stage that consumes an image or a model types against these.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from pipelines.core.modellock import Lock


@dataclass(frozen=True)
class PublishedImage:
    """An image as later stages take it: pinned by digest when asked, after the tasks that
    build it (none when the run was given a digest CI pushed, or no image is wanted)."""

    ref: Callable[[], str]  # the image pinned by digest
    tasks: tuple[str, ...]  # the tasks that must run before ref() answers
    wanted: bool = True  # False: the profile uses no such image (the stager of one member)


class PublishedModel(Protocol):
    """The model as later stages take it: its lock, its patch program and where it is staged."""

    lock_file: Path
    patch_source: Path
    stage_task: str  # the task that leaves the model staged on this machine

    @property
    def node_weights_root(self) -> str:
        """Where the members keep the weights."""
        ...

    @property
    def source_tasks(self) -> tuple[str, ...]:
        """The tasks that put the model into its bucket."""
        ...

    def is_locked(self) -> bool:
        """Whether the lock names every file's size and sha256."""
        ...

    def member_roots(self) -> list[str]:
        """Each member's weights folder, by rank."""
        ...

    def model_folder(self) -> str:
        """The staged model's folder under a weights root."""
        ...

    def ring_plan_json(self) -> str:
        """The ring's staging plan, as its members read it."""
        ...

    def read_lock(self) -> Lock:
        """The profile's lock, checked against the profile's source."""
        ...

    def signature_problems(self) -> list[str]:
        """One line when the model's signature does not verify."""
        ...

    def patch_source_text(self) -> str:
        """The config patch program, as the patch Job runs it."""
        ...
