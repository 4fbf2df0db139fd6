"""The weights stage: lock, fetch, verify and stage the model's files, and the TP3 patch.

Other stages use only what is exported here. The exports load on first use, so that a ring
member (`python -m pipelines.weights.ring`, in the weights-stager image) imports only what it
runs: not doit, not the stage's task code.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipelines.weights.lock import Lock, LockEntry, cache_key
    from pipelines.weights.options import FetchOptions, WeightsSettings
    from pipelines.weights.tasks import ModelOutputs, Weights

EXPORTS = {
    "Lock": "pipelines.weights.lock",
    "LockEntry": "pipelines.weights.lock",
    "cache_key": "pipelines.weights.lock",
    "FetchOptions": "pipelines.weights.options",
    "WeightsSettings": "pipelines.weights.options",
    "ModelOutputs": "pipelines.weights.tasks",
    "Weights": "pipelines.weights.tasks",
}

__all__ = [
    "FetchOptions",
    "Lock",
    "LockEntry",
    "ModelOutputs",
    "Weights",
    "WeightsSettings",
    "cache_key",
]


def __getattr__(name: str) -> Any:
    """An export, imported from its module on first use."""
    if name not in EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(EXPORTS[name]), name)
