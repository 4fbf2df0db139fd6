"""A git repository laid out like the llmkube operator's, written by the tests: two small CRDs
of the operator's group, committed on main at a fixed date (nothing of the operator's)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import yaml


def git(repo: Path, *args: str) -> str:
    """Run git in a test repository."""
    env = {
        **os.environ,
        "GIT_AUTHOR_DATE": "2026-08-22T11:17:43-07:00",
        "GIT_COMMITTER_DATE": "2026-08-22T11:17:43-07:00",
    }
    return subprocess.run(
        ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
        check=True,
        capture_output=True,
        text=True,
        env=env,
    ).stdout


def crd(kind: str, plural: str, spec_schema: dict) -> dict:
    """A small CustomResourceDefinition of the llmkube group."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.inference.llmkube.dev"},
        "spec": {
            "group": "inference.llmkube.dev",
            "names": {"kind": kind, "plural": plural},
            "versions": [
                {
                    "name": "v1alpha1",
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": "prose",
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": spec_schema,
                            },
                        }
                    },
                }
            ],
        },
    }


def operator_repo(tmp_path: Path, extra: dict | None = None) -> Path:
    """A git repository laid out like the operator's, with two small CRDs committed."""
    repo = tmp_path / "operator"
    (repo / "config/crd/bases").mkdir(parents=True)
    git(repo, "init", "-q", "-b", "main")
    spec = {
        "type": "object",
        "description": "the spec",
        "required": ["source"],
        "properties": {
            "source": {"type": "string", "pattern": "^s3://", "description": "where"},
            "size": {
                "anyOf": [{"type": "integer"}, {"type": "string"}],
                "x-kubernetes-int-or-string": True,
            },
            "opaque": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
            "gpu": {
                "type": "object",
                "x-kubernetes-map-type": "atomic",
                **(extra or {}),
                "x-kubernetes-validations": [{"rule": "self.count <= 8", "message": "at most 8"}],
                "properties": {"count": {"type": "integer", "minimum": 0, "maximum": 8}},
            },
        },
    }
    for kind, plural in (("Model", "models"), ("InferenceService", "inferenceservices")):
        path = repo / f"config/crd/bases/inference.llmkube.dev_{plural}.yaml"
        path.write_text(yaml.safe_dump(crd(kind, plural, spec)))
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "crds")
    return repo
