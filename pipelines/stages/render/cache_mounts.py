"""Policy (ours): every cache an InferenceService's env points at lives on a volume it mounts.

A cache path no volume provides is the container's own layer: lost at every restart, so each
reboot recompiles every kernel (and fills the node's container storage meanwhile).
"""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Any

from pipelines.stages.render.documents import Document
from pipelines.stages.render.violations import violation

# Variables that name a cache folder (model hub, JIT kernels, compile caches).
CACHE_VARIABLES = (
    "HF_HOME",
    "HF_HUB_CACHE",
    "HUGGINGFACE_HUB_CACHE",
    "TRANSFORMERS_CACHE",
    "HF_DATASETS_CACHE",
    "VLLM_CACHE_ROOT",
    "TRITON_CACHE_DIR",
    "TORCHINDUCTOR_CACHE_DIR",
    "TORCH_EXTENSIONS_DIR",
    "TORCH_HOME",
    "CUDA_CACHE_PATH",
    "FLASHINFER_WORKSPACE_BASE",
    "XDG_CACHE_HOME",
)
RULE = (
    "cache variable points at a path no writable extraVolumeMounts entry provides"
    " (a restart loses it) [layer 3 policy]"
)


def writable_mounts(spec: dict[str, Any]) -> list[PurePosixPath]:
    """Mount paths of the spec's extra volumes that exist and may be written.

    The operator's own /models mount is read-only in the serving container, so only the
    service's extraVolumeMounts can hold a cache.
    """
    volumes = {v.get("name") for v in spec.get("extraVolumes") or []}
    return [
        PurePosixPath(m["mountPath"])
        for m in spec.get("extraVolumeMounts") or []
        if m.get("name") in volumes and not m.get("readOnly") and m.get("mountPath")
    ]


def provided(path: str, mounts: list[PurePosixPath]) -> bool:
    """Whether an absolute path lies on (or under) one of the mounts."""
    target = PurePosixPath(path)
    return target.is_absolute() and any(target.is_relative_to(m) for m in mounts)


def check_cache_mounts(docs: list[Document]) -> list[str]:
    """Each cache variable whose path no writable volume mount provides, one line each."""
    found = []
    for doc in docs:
        if doc.body.get("kind") != "InferenceService":
            continue
        spec = doc.body.get("spec") or {}
        mounts = writable_mounts(spec)
        for item in spec.get("env") or []:
            name, value = item.get("name"), item.get("value")
            if name in CACHE_VARIABLES and value and not provided(value, mounts):
                found.append(violation(doc.file, ["spec", "env", name], RULE, value))
    return found
