"""doit's `name=value` arguments the stages read, and what each means: read once, in dodo.py,
into the run's Context; a task names the ones that change what it does (`doit help TASK`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# name -> (how it is written, what it does). `profile` is read by every task.
VARIABLES: dict[str, tuple[str, str]] = {
    "profile": ("profile=NAME", "the profile to use (pipelines/profiles/NAME.yaml); default local"),
    "image_digest": (
        "image_digest=sha256:HEX",
        "the runtime image CI pushed, pinned by it: nothing of it built here",
    ),
    "stager_digest": (
        "stager_digest=sha256:HEX",
        "the ring's weights-stager image CI pushed, pinned by it",
    ),
    "expect": (
        "expect=RULE",
        "the fabric check's expectation by hand (P2P>=200), not the profile's",
    ),
    "prune": ("prune=no", "keep what a new render dropped (default: delete it)"),
    "platform": (
        "platform=linux/arm64",
        "build the images for it, not image.yaml's platform (emulated here)",
    ),
}


def reading(names: Sequence[str]) -> dict[str, Any]:
    """The task dict entry naming the variables a task reads besides `profile`."""
    unknown = [name for name in names if name not in VARIABLES]
    if unknown:
        raise ValueError(f"unknown doit variables {unknown}: expected some of {list(VARIABLES)}")
    return {"meta": {"variables": ["profile", *names]}}
