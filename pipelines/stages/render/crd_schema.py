"""Layer 1: llmkube documents against the derived CRD schemas plus the PR #1746 overlay.

Unknown fields are forbidden as the operator's own scripts/validate-samples.py forbids them:
every object schema without `additionalProperties` gets `false`, except the root `metadata`
and nodes marked x-kubernetes-preserve-unknown-fields.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from pipelines.core.errors import PipelineError
from pipelines.core.paths import LLMKUBE_SCHEMAS_DIR
from pipelines.stages.render.documents import Document
from pipelines.stages.render.violations import violation

OVERLAY = "overlay-pr1746.json"


@dataclass(frozen=True)
class OperatorSchema:
    """One kind's schema as checked: derived, overlaid, and where each part comes from."""

    schema: dict[str, Any]
    source: str  # the CRD file and commit it was derived from
    overlay_source: str  # the PR the overlay cites
    added: tuple[str, ...]  # dotted paths the overlay added (empty once the CRD has them)
    constrained: tuple[str, ...] = ()  # fields the overlay gave a keyword (not their children)
    overlay_rules: frozenset[str] = frozenset()  # the CEL rules' texts the overlay placed


@cache
def source_record(folder: Path = LLMKUBE_SCHEMAS_DIR) -> dict[str, Any]:
    """The record of where the derived schemas come from (repository, commit, files)."""
    record: dict[str, Any] = json.loads((folder / "source.json").read_text())
    return record


def read_json(path: Path) -> dict[str, Any]:
    """A JSON file of the derived-schema folder."""
    found: dict[str, Any] = json.loads(path.read_text())
    return found


def apply_overlay(
    schema: dict[str, Any],
    additions: dict[str, dict[str, Any]],
    constraints: dict[str, dict[str, Any]] | None = None,
) -> tuple[dict[str, Any], tuple[str, ...], tuple[str, ...], frozenset[str]]:
    """The schema with each addition placed where it is missing, and each constraint's
    keywords (a pattern, CEL rules) set on its field where the field lacks them; the paths
    added, the paths constrained, and the texts of the CEL rules placed."""
    out = copy.deepcopy(schema)
    added, constrained, rules = [], [], set()
    for dotted, fragment in additions.items():
        *parents, leaf = dotted.split(".")
        props = node_at(out, dotted, parents).setdefault("properties", {})
        if leaf not in props:  # present: the derived CRD already has the field, it wins
            props[leaf] = copy.deepcopy(fragment)
            added.append(dotted)
            rules |= {r["rule"] for r in rules_in(fragment)}
    for dotted, keywords in (constraints or {}).items():
        node = node_at(out, dotted, dotted.split("."))
        for key, value in keywords.items():
            if key == "x-kubernetes-validations":  # a rule the CRD has by its text is kept
                have = {r["rule"] for r in node.get(key, [])}
                new = [r for r in value if r["rule"] not in have]
                node[key] = node.get(key, []) + copy.deepcopy(new)
                rules |= {r["rule"] for r in new}
            elif key not in node:
                node[key] = copy.deepcopy(value)
                constrained.append(dotted)
    return out, tuple(added), tuple(constrained), frozenset(rules)


def rules_in(node: Any) -> list[dict[str, Any]]:
    """Every CEL rule in a schema fragment."""
    if isinstance(node, list):
        return [r for v in node for r in rules_in(v)]
    if not isinstance(node, dict):
        return []
    found = list(node.get("x-kubernetes-validations", []))
    return found + [r for k, v in node.items() if k != "x-kubernetes-validations"
                    for r in rules_in(v)]  # fmt: skip


def node_at(schema: dict[str, Any], dotted: str, parts: list[str]) -> dict[str, Any]:
    """The schema node of the field at parts (the root for none); a part the derived schema
    does not have means the overlay is stale, said naming it."""
    node = schema
    for part in parts:
        node = node.get("properties", {}).get(part)
        if node is None:
            raise PipelineError(f"{OVERLAY}: {dotted}: the derived schema has no {part!r}")
    return node


@cache
def operator_schema(kind: str, folder: Path = LLMKUBE_SCHEMAS_DIR) -> OperatorSchema:
    """The derived schema of an llmkube kind with the overlay applied."""
    record = source_record(folder)
    name = f"{kind.lower()}.json"
    file = next(f for f in record["files"] if f["derived"] == name)
    overlay = read_json(folder / OVERLAY)
    schema, added, constrained, rules = apply_overlay(
        read_json(folder / name)["schema"],
        overlay["add"].get(kind, {}),
        overlay.get("constrain", {}).get(kind, {}),
    )
    return OperatorSchema(
        schema=schema,
        source=f"LLMKube@{record['commit'][:8]} {Path(file['path']).name}",
        overlay_source=f"LLMKube PR #{overlay['source'].rsplit('/', 1)[-1]}",
        added=added,
        constrained=constrained,
        overlay_rules=rules,
    )


def known_kinds(folder: Path = LLMKUBE_SCHEMAS_DIR) -> set[str]:
    """The llmkube kinds a derived schema exists for."""
    return {f["kind"] for f in source_record(folder)["files"]}


def forbid_unknown(node: Any, root: bool = True) -> Any:
    """A copy of the schema with unknown fields forbidden (validate-samples.py's semantics)."""
    if isinstance(node, list):
        return [forbid_unknown(v, root=False) for v in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        # Values under these keys are data (an enum value, a default), not schemas.
        if key in ("enum", "default", "required", "x-kubernetes-validations"):
            out[key] = value
        elif key == "properties":
            out[key] = {
                name: value[name]
                if root and name == "metadata"  # the API server owns metadata's schema
                else forbid_unknown(value[name], root=False)
                for name in value
            }
        else:
            out[key] = forbid_unknown(value, root=False)
    if (
        out.get("type") == "object"
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


@cache
def validator(kind: str, folder: Path = LLMKUBE_SCHEMAS_DIR) -> Any:
    """A Draft 2020-12 validator of the strict schema (built once per kind)."""
    import jsonschema  # loaded when something is rendered, not for a no-op run

    return jsonschema.Draft202012Validator(forbid_unknown(operator_schema(kind, folder).schema))


def source_of(schema: OperatorSchema, path: list[str | int]) -> str:
    """Which source a field's schema comes from: the overlay's PR or the derived CRD."""
    dotted = ".".join(str(p) for p in path if not isinstance(p, int))
    if dotted in schema.constrained or any(
        dotted == a or dotted.startswith(a + ".") for a in schema.added
    ):
        return f"{schema.overlay_source} overlay"
    return schema.source


def check_crd_schema(doc: Document, folder: Path = LLMKUBE_SCHEMAS_DIR) -> list[str]:
    """Every layer-1 violation of an llmkube document, one line each."""
    kind = doc.body.get("kind")
    if kind not in known_kinds(folder):
        rule = "no derived schema for this llmkube kind [layer 1 schema, source.json]"
        return [violation(doc.file, ["kind"], rule, kind)]
    schema = operator_schema(kind, folder)
    errors = sorted(validator(kind, folder).iter_errors(doc.body), key=lambda e: list(e.path))
    return [
        violation(
            doc.file,
            e.absolute_path,
            f"{e.message} [layer 1 schema, {source_of(schema, list(e.absolute_path))}]",
            e.instance,
        )
        for e in errors
    ]
