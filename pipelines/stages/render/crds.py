"""Derive our compact llmkube schemas from the operator's CRDs, and check them against its files.

`python -m pipelines.stages.render.crds derive --repo GITDIR --commit SHA` writes the schemas;
`python -m pipelines.stages.render.crds check --operator GITDIR` derives them again at the recorded
commit and runs the operator's own samples through them (README "Refreshing the operator's
schemas"). The operator's files are read from its checkout, never copied into this project.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import yaml

from pipelines.core.errors import BadInput, run_main
from pipelines.core.paths import LLMKUBE_SCHEMAS_DIR
from pipelines.core.progress import say, show
from pipelines.stages.render.crd_diff import schema_changes
from pipelines.stages.render.crd_keywords import DROP, KEEP, NESTED
from pipelines.stages.render.crd_schema import check_crd_schema
from pipelines.stages.render.documents import Document
from pipelines.stages.render.operator_rules import check_operator_rules

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
RULE_KEYS = ("rule", "message", "messageExpression", "fieldPath", "reason")
# Where the operator keeps documents of its own kinds that it ships as working examples.
SAMPLE_FOLDERS = ("config/samples", "examples")
SAMPLE_KINDS = ("Model", "InferenceService")
LLMKUBE_API = "inference.llmkube.dev/"


class DeriveError(BadInput):
    """A CRD the deriver cannot turn into a schema without losing a fact."""


def git_show(repo: Path, commit: str, path: str) -> bytes:
    """The bytes of one file of the repository at a commit."""
    result = subprocess.run(
        ["git", "-C", str(repo), "show", f"{commit}:{path}"], capture_output=True, check=False
    )
    if result.returncode:
        raise DeriveError(f"{repo}: {commit}:{path}: {result.stderr.decode().strip()}")
    return result.stdout


def git_tree(repo: Path, commit: str, folders: tuple[str, ...]) -> list[str]:
    """The paths of every file under folders in the repository at a commit, sorted."""
    result = subprocess.run(
        ["git", "-C", str(repo), "ls-tree", "-r", "--name-only", commit, "--", *folders],
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode:
        raise DeriveError(f"{repo}: {commit}: {result.stderr.strip()}")
    return sorted(result.stdout.splitlines())


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


def schema_text(body: dict[str, Any]) -> str:
    """A derived file's bytes as committed: sorted keys, one-space indent, a final newline."""
    return json.dumps(body, indent=1, sort_keys=True) + "\n"


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
        "deriver": "pipelines/stages/render/crds.py",
        "files": files,
    }
    out.mkdir(parents=True, exist_ok=True)
    for name, body in {**derived, SOURCE_RECORD: record}.items():
        (out / name).write_text(schema_text(body))
    return record


def operator_samples(repo: Path, commit: str) -> list[Document]:
    """Every Model and InferenceService the operator ships under its samples and examples."""
    docs = []
    for path in git_tree(repo, commit, SAMPLE_FOLDERS):
        if not path.endswith((".yaml", ".yml")):
            continue
        try:
            bodies = list(yaml.safe_load_all(git_show(repo, commit, path)))
        except yaml.YAMLError as err:
            raise DeriveError(f"{path}: not YAML: {str(err).splitlines()[0]}") from None
        for n, body in enumerate(bodies):
            ours = isinstance(body, dict) and str(body.get("apiVersion")).startswith(LLMKUBE_API)
            if ours and body.get("kind") in SAMPLE_KINDS:
                docs.append(Document(f"{path}#{n}", body))
    return docs


def check(repo: Path, schemas: Path = LLMKUBE_SCHEMAS_DIR) -> tuple[list[str], list[str]]:
    """Check the committed schemas against the operator's checkout: (findings, problems).

    At the commit source.json records, each CRD must have the recorded sha256 and derive to
    the committed file byte for byte, and every sample must pass layers 1 and 2 with the
    schemas of that folder (and its overlay). Where the checkout's HEAD is another commit,
    each CRD that moved since is derived there and what changed is listed (a problem: the
    schemas are behind), and HEAD's samples must pass the committed schemas too.
    """
    record = read_record(schemas)
    commit = record.commit
    findings: list[str] = []
    problems: list[str] = []
    for f in record.files:
        text = git_show(repo, commit, f.path)
        digest = hashlib.sha256(text).hexdigest()
        if digest != f.sha256:
            problems.append(f"{f.path}: sha256 {digest}, source.json records {f.sha256}")
            continue
        derived = schema_text(derive_kind(text, f.kind, f.path))
        committed = schemas / f.derived
        if not committed.is_file() or committed.read_text() != derived:
            problems.append(f"{committed}: differs from what {f.path} derives to")
        else:
            findings.append(f"{committed.name}: byte-identical to what {f.path} derives to")
    problems += samples_refused(repo, commit, schemas, findings, "")
    head, _ = commit_of(repo, "HEAD")
    if head != commit:
        moved = drift(repo, head, record, schemas, findings)
        problems += moved + samples_refused(repo, head, schemas, findings, f" at HEAD {head[:12]}")
        if not moved:
            findings.append(f"HEAD {head[:12]}: no CRD changed since {commit[:12]}")
    return findings, problems


def samples_refused(
    repo: Path, commit: str, schemas: Path, findings: list[str], at: str
) -> list[str]:
    """The operator's samples at a commit through the committed schemas: a line of how many
    pass into findings, every refusal returned."""
    samples = operator_samples(repo, commit)
    refused_all: list[str] = []
    passed = 0
    for doc in samples:
        refused = check_crd_schema(doc, schemas) + check_operator_rules(doc, schemas)
        refused_all += refused
        passed += not refused
    findings.append(
        f"{passed} of {len(samples)} samples (Model, InferenceService) under"
        f" {', '.join(SAMPLE_FOLDERS)}{at} pass layers 1 and 2"
    )
    return refused_all


def drift(
    repo: Path, head: str, record: SourceRecord, schemas: Path, findings: list[str]
) -> list[str]:
    """Each CRD that moved between the recorded commit and head: what changed in its derived
    schema into findings, one problem line per CRD returned."""
    problems = []
    for f in record.files:
        try:
            text = git_show(repo, head, f.path)
        except DeriveError:
            problems.append(f"{f.path}: gone at HEAD {head[:12]}")
            continue
        if hashlib.sha256(text).hexdigest() == f.sha256:
            continue
        committed = json.loads((schemas / f.derived).read_text())
        changes = schema_changes(committed["schema"], derive_kind(text, f.kind, f.path)["schema"])
        findings.append(f"{f.kind} at HEAD {head[:12]} against {f.derived}:")
        findings += [f"  {line}" for line in changes] or ["  (prose only: nothing derived moved)"]
        if changes:
            problems.append(
                f"{f.path}: {len(changes)} change(s) since {record.commit[:12]}, the commit"
                f" {schemas / SOURCE_RECORD} records: derive again, review the diff, commit"
            )
    return problems


class SourceFile(msgspec.Struct, frozen=True):
    """One CRD a derived schema comes from."""

    kind: str
    path: str
    sha256: str
    derived: str


class SourceRecord(msgspec.Struct, frozen=True):
    """What check reads of source.json: the operator's commit and its CRD files."""

    commit: str
    files: list[SourceFile]


def read_record(schemas: Path) -> SourceRecord:
    """The schemas' source.json, checked; DeriveError naming the file and the field."""
    path = schemas / SOURCE_RECORD
    try:
        return msgspec.json.decode(path.read_bytes(), type=SourceRecord)
    except OSError as err:
        raise DeriveError(f"{path}: {err.strerror}") from None
    except msgspec.ValidationError as err:
        raise DeriveError(f"{path}: {err}") from None
    except msgspec.DecodeError:
        raise DeriveError(f"{path}: not JSON") from None


def main(argv: list[str] | None = None) -> int:
    """`derive` refreshes the derived schemas; `check` compares them with the operator's files."""
    parser = argparse.ArgumentParser(prog="python -m pipelines.stages.render.crds")
    sub = parser.add_subparsers(dest="command", required=True)
    cmd = sub.add_parser("derive", help="derive our schemas from the operator's CRDs")
    cmd.add_argument("--repo", type=Path, required=True, help="the operator's git directory")
    cmd.add_argument("--commit", required=True, help="the commit to read (hash or ref)")
    cmd.add_argument("--out", type=Path, default=LLMKUBE_SCHEMAS_DIR)
    cmd = sub.add_parser("check", help="check the committed schemas against the operator's files")
    cmd.add_argument("--operator", type=Path, required=True, help="the operator's git directory")
    cmd.add_argument("--schemas", type=Path, default=LLMKUBE_SCHEMAS_DIR)
    args = parser.parse_args(argv)
    # A folder that is not the operator's repository, or lacks the commit: DeriveError, exit 2.
    if args.command == "check":
        findings, problems = check(args.operator, args.schemas)
        for line in findings:
            show(line)
        for line in problems:
            say("error", f"{line}", stream=sys.stderr)
        return 1 if problems else 0
    record = derive(args.repo, args.commit, args.out)
    for f in record["files"]:
        say(args.out / f["derived"], f"{f['path']} @ {record['commit'][:8]} ({f['sha256']})")
    return 0


if __name__ == "__main__":
    run_main(main)
