"""What changed between two derived schemas of one kind: fields added and removed, types and
bounds moved, required fields and CEL rules changed. One line per change, in schema order."""

from __future__ import annotations

import json
from typing import Any

from pipelines.stages.render.crd_keywords import KEEP

# Keywords of a node compared as values: what the deriver keeps, less the nested ones (walked
# instead) and `required` (compared name by name), plus the combinators (compared whole).
COMPARED = (*sorted(KEEP - {"required"}), "anyOf", "allOf", "oneOf", "not")


def shown(value: Any) -> str:
    """A keyword's value as one short JSON text."""
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 80 else text[:77] + "..."


def kind_of(node: dict[str, Any]) -> str:
    """A field's type in a line: its type, or what stands for one."""
    if "type" in node:
        return str(node["type"])
    if node.get("x-kubernetes-int-or-string"):
        return "int-or-string"
    return "any"


def schema_changes(old: dict[str, Any], new: dict[str, Any], where: str = "") -> list[str]:
    """Every change from old to new under where, as `+ path`, `- path` and `~ path` lines."""
    here = where or "(root)"
    lines = []
    for key in COMPARED:
        if old.get(key) != new.get(key):
            before = shown(old[key]) if key in old else "unset"
            after = shown(new[key]) if key in new else "unset"
            lines.append(f"~ {here} {key}: {before} -> {after}")
    for name in sorted(set(new.get("required", [])) - set(old.get("required", []))):
        lines.append(f"~ {where}.{name}: now required")
    for name in sorted(set(old.get("required", [])) - set(new.get("required", []))):
        lines.append(f"~ {where}.{name}: no longer required")
    lines += rule_changes(
        old.get("x-kubernetes-validations", []), new.get("x-kubernetes-validations", []), here
    )
    before, after = old.get("properties", {}), new.get("properties", {})
    for name in sorted(set(before) | set(after)):
        path = f"{where}.{name}"
        if name not in before:
            lines.append(f"+ {path} ({kind_of(after[name])})")
        elif name not in after:
            lines.append(f"- {path}")
        else:
            lines += schema_changes(before[name], after[name], path)
    for key, step in (("items", "[]"), ("additionalProperties", "{}")):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            lines += schema_changes(a, b, f"{where}{step}")
        elif a != b:
            lines.append(f"~ {here} {key}: {shown(a)} -> {shown(b)}")
    return lines


def rule_changes(old: list[dict[str, Any]], new: list[dict[str, Any]], here: str) -> list[str]:
    """CEL rules added, removed or given another message at one node, by their rule text."""
    before = {r["rule"]: r for r in old}
    after = {r["rule"]: r for r in new}
    lines = [f"+ {here} rule: {r}" for r in after if r not in before]
    lines += [f"- {here} rule: {r}" for r in before if r not in after]
    for rule in after:
        if rule in before and before[rule] != after[rule]:
            lines.append(f"~ {here} rule {rule}: {shown(before[rule])} -> {shown(after[rule])}")
    return lines
