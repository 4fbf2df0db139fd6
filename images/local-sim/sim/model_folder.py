"""The staged model folder's completeness: the server refuses to start without it."""

from __future__ import annotations

import json
from pathlib import Path


def missing_model_files(folder: Path) -> list[str]:
    """What keeps the model folder from being complete: config.json and every indexed shard."""
    missing = []
    config = folder / "config.json"
    try:
        json.loads(config.read_text())
    except (OSError, ValueError):
        missing.append("config.json")
    try:
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        shards = sorted(set(index["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return [*missing, "model.safetensors.index.json (with a weight_map)"]
    for name in shards:
        path = folder / name
        if not path.is_file() or path.stat().st_size == 0:
            missing.append(name if not path.is_file() else f"{name} (empty)")
    return missing
