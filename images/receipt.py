"""Written into every image: what it was built from (versions, upstream commits, input key)."""

import contextlib
import hashlib
import importlib.metadata
import json
import os
import platform
import sys
from pathlib import Path

PACKAGES = ("torch", "vllm", "sglang", "flashinfer-python", "exllamav3", "nvidia-nccl-cu12")


def tree_hash(folder: Path) -> str:
    """sha256 over the sorted relative paths and contents of a folder (the installed vLLM)."""
    digest = hashlib.sha256()
    for path in sorted(
        p for p in folder.rglob("*") if p.is_file() and "__pycache__" not in p.parts
    ):
        digest.update(str(path.relative_to(folder)).encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def receipt() -> dict:
    """The receipt of this image."""
    versions = {}
    for name in PACKAGES:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[name] = importlib.metadata.version(name)
    trees = {}
    try:
        import vllm

        trees["vllm"] = tree_hash(Path(vllm.__file__).parent)
    except ImportError:
        pass
    commits = {k.lower(): v for k, v in os.environ.items() if k.endswith("_COMMIT")}
    return {
        "input_key": os.environ.get("SPARKFORGE_IMAGE_KEY", ""),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "packages": versions,
        "upstream_commits": commits,
        "installed_tree_sha256": trees,
    }


if __name__ == "__main__":
    json.dump(receipt(), sys.stdout, indent=2, sort_keys=True)
    sys.stdout.write("\n")
