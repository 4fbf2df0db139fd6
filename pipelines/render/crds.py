"""Derive our compact llmkube schemas from the operator's CRDs at one commit of its repository.

Run `python -m pipelines.render.crds derive --repo GITDIR --commit SHA` (README "Render").
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from pipelines.errors import PipelineError
from pipelines.paths import LLMKUBE_SCHEMAS_DIR

REPOSITORY = "https://github.com/defilantech/LLMKube"
# (kind, CRD file in the operator's repository, our derived file)
SOURCES = (
    ("Model", "config/crd/bases/inference.llmkube.dev_models.yaml", "model.json"),
    (
        "InferenceService",
        "config/crd/bases/inference.llmkube.dev_inferenceservices.yaml",
        "inferenceservice.json",
    ),
)
SOURCE_RECORD = "source.json"
# What a check can use: structure, types, bounds, defaults and the CEL rules.
KEEP = {
    "type", "format", "enum", "default", "nullable", "pattern",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
    "minLength", "maxLength", "minItems", "maxItems", "uniqueItems",
    "minProperties", "maxProperties", "required",
    "x-kubernetes-int-or-string", "x-kubernetes-preserve-unknown-fields",
    "x-kubernetes-embedded-resource", "x-kubernetes-list-type", "x-kubernetes-list-map-keys",
}  # fmt: skip
NESTED = {"properties", "items", "additionalProperties", "anyOf", "allOf", "oneOf", "not"}
# Prose and server-side-apply hints: nothing a validator reads.
DROP = {"description", "example", "externalDocs", "title", "x-kubernetes-map-type"}
RULE_KEYS = ("rule", "message", "messageExpression", "fieldPath", "reason")


class DeriveError(PipelineError):
    """A CRD the deriver cannot turn into a schema without losing a fact."""


def git_show(repo: Path, commit: str, path: str) -> bytes:
    """The bytes of one file of the repository at a commit."""
    result = subprocess.run(
        ["git", "-C", str(repo), "show", f"{commit}:{path}"], capture_output=True, check=False
    )
    if result.returncode:
        raise DeriveError(f"{repo}: {commit}:{path}: {result.stderr.decode().strip()}")
    return result.stdout


def commit_of(repo: Path, commit: str) -> tuple[str, str]:
    """The full hash and the committer date (ISO 8601) of a commit."""
    result = subprocess.run(
        ["git", "-C", str(repo), "log", "-1", "--format=%H %cI", commit],
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode:
        raise DeriveError(f"{repo}: commit {commit}: {result.stderr.strip()}")
    full, date = result.stdout.split()
    return full, date


def compact(node: Any, where: str = "") -> Any:
    """A schema node without prose; an unknown keyword is an error, never silently dropped."""
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in DROP:
            continue
        if key == "properties":
            out[key] = {k: compact(v, f"{where}.{k}") for k, v in value.items()}
        elif key in ("anyOf", "allOf", "oneOf"):
            out[key] = [compact(v, where) for v in value]
        elif key in NESTED:
            out[key] = compact(value, f"{where}[]" if key == "items" else where)
        elif key == "x-kubernetes-validations":
            out[key] = [{k: r[k] for k in RULE_KEYS if k in r} for r in value]
        elif key in KEEP:
            out[key] = value
        else:
            raise DeriveError(f"{where or '(root)'}: keyword {key!r} is not one the deriver knows")
    return out


def derive_kind(crd_text: bytes, kind: str, path: str) -> dict[str, Any]:
    """Our compact schema of the one served version of a CRD."""
    crd = yaml.safe_load(crd_text)
    if crd.get("kind") != "CustomResourceDefinition" or crd["spec"]["names"]["kind"] != kind:
        raise DeriveError(f"{path}: not the CustomResourceDefinition of {kind}")
    served = [v for v in crd["spec"]["versions"] if v.get("served") and v.get("storage")]
    if len(served) != 1:
        raise DeriveError(f"{path}: expected one served storage version, found {len(served)}")
    version = served[0]
    return {
        "apiVersion": f"{crd['spec']['group']}/{version['name']}",
        "kind": kind,
        "schema": compact(version["schema"]["openAPIV3Schema"]),
    }


def derive(repo: Path, commit: str, out: Path = LLMKUBE_SCHEMAS_DIR) -> dict[str, Any]:
    """Write the derived schemas and their source record; return the record."""
    full, date = commit_of(repo, commit)
    files = []
    derived = {}
    for kind, path, name in SOURCES:
        text = git_show(repo, full, path)
        derived[name] = derive_kind(text, kind, path)
        files.append(
            {
                "kind": kind,
                "path": path,
                "sha256": hashlib.sha256(text).hexdigest(),
                "derived": name,
            }
        )
    record = {
        "repository": REPOSITORY,
        "commit": full,
        "date": date,
        "deriver": "pipelines/render/crds.py",
        "files": files,
    }
    out.mkdir(parents=True, exist_ok=True)
    for name, body in {**derived, SOURCE_RECORD: record}.items():
        (out / name).write_text(json.dumps(body, indent=1, sort_keys=True) + "\n")
    return record


def main(argv: list[str] | None = None) -> int:
    """`derive --repo GITDIR --commit SHA [--out DIR]`: refresh the derived schemas."""
    parser = argparse.ArgumentParser(prog="python -m pipelines.render.crds")
    sub = parser.add_subparsers(dest="command", required=True)
    cmd = sub.add_parser("derive", help="derive our schemas from the operator's CRDs")
    cmd.add_argument("--repo", type=Path, required=True, help="the operator's git directory")
    cmd.add_argument("--commit", required=True, help="the commit to read (hash or ref)")
    cmd.add_argument("--out", type=Path, default=LLMKUBE_SCHEMAS_DIR)
    args = parser.parse_args(argv)
    try:
        record = derive(args.repo, args.commit, args.out)
    except PipelineError as err:
        print(err, file=sys.stderr)
        return 1
    for f in record["files"]:
        print(f"{args.out / f['derived']}: {f['path']} @ {record['commit'][:8]} ({f['sha256']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
