"""The weights stage: lock, fetch, verify and stage the model's files, and the TP3 patch.

Other stages use only what is exported here.
"""

from pipelines.weights.lock import Lock, LockEntry, cache_key
from pipelines.weights.options import FetchOptions, WeightsSettings
from pipelines.weights.tasks import ModelOutputs, Weights

__all__ = [
    "FetchOptions",
    "Lock",
    "LockEntry",
    "ModelOutputs",
    "Weights",
    "WeightsSettings",
    "cache_key",
]
