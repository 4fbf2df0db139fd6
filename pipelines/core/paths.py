"""Where the checkout keeps what the pipeline reads: the one table of repository paths."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]  # pipelines/core/paths.py
PIPELINES_DIR = REPO_ROOT / "pipelines"
PROFILES_DIR = PIPELINES_DIR / "profiles"
IMAGES_DIR = REPO_ROOT / "images"
RECEIPT = IMAGES_DIR / "receipt.py"
MANIFESTS_DIR = REPO_ROOT / "manifests"
SCHEMAS_DIR = MANIFESTS_DIR / "schemas"
FABRIC_PROBE = MANIFESTS_DIR / "fabric" / "probe.py"  # the fabric check's all-reduce, as source
LOCKS_DIR = REPO_ROOT / "weights"
PATCH_SOURCE = PIPELINES_DIR / "stages" / "weights" / "patch.py"
RENDER_DIR = PIPELINES_DIR / "stages" / "render"  # the renderers' code (a key input of render)
PROFILES_MODULE = PIPELINES_DIR / "core" / "profiles.py"  # the profile model and its defaults
SCHEMA_MODULE = PIPELINES_DIR / "core" / "schema.py"
DEFAULT_STORE = REPO_ROOT / ".store"
LLMKUBE_SCHEMAS_DIR = SCHEMAS_DIR / "llmkube"  # derived from the operator's CRDs (render/crds.py)
