"""The weights stage: lock, fetch, verify and stage the model's files, and the TP3 patch.

dodo.py makes the stage from here; it publishes a PublishedModel (engine/published.py). The
class loads on first use, so that a ring member (`python -m pipelines.stages.weights.ring`, in
the weights-stager image) imports only what it runs: not doit, not the stage's task code.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipelines.stages.weights.tasks import Weights

__all__ = ["Weights"]


def __getattr__(name: str) -> Any:
    """An export, imported from its module on first use."""
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module("pipelines.stages.weights.tasks"), name)
