"""Step keys: the sha256 of a canonical JSON of everything that can change a step's output."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any


def canonical_json(value: Any) -> bytes:
    """JSON with sorted keys and no whitespace: one byte string per value, on any machine."""
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode()


def key_material(
    recipe: str,
    version: int,
    params: Mapping[str, Any],
    inputs: Mapping[str, str],
    deps: Mapping[str, str],
) -> dict[str, Any]:
    """Everything a step key is computed from, as one plain dict (also what `explain` compares)."""
    return {
        "recipe": recipe,
        "version": version,
        "params": dict(params),
        "inputs": dict(inputs),
        "deps": dict(deps),
    }


def step_key(material: Mapping[str, Any]) -> str:
    """The key of a step: sha256 over the canonical JSON of its key material."""
    return hashlib.sha256(canonical_json(material)).hexdigest()
