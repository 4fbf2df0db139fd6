"""Layer 2: the operator's own rules: its CRDs' CEL rules, and what it checks when it reconciles."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from pipelines.core.paths import LLMKUBE_SCHEMAS_DIR
from pipelines.stages.render.crd_schema import known_kinds, operator_schema
from pipelines.stages.render.documents import Document
from pipelines.stages.render.violations import violation

GUARD = "layer 2 reconcile-time rule, LLMKube PR #1746"
ITEMS, VALUES = "[]", "{}"  # a rule path step into every list item / every map value


@dataclass(frozen=True)
class CelRule:
    """One x-kubernetes-validations rule and where in the schema it sits."""

    where: tuple[str, ...]  # property names, ITEMS or VALUES, from the document's root
    index: int  # its position in that node's x-kubernetes-validations
    rule: str
    message: str

    def name(self) -> str:
        """The rule's name in a message: its schema path and index."""
        return ".".join(self.where).replace(".[]", "[]").replace(".{}", "{}") + f"#{self.index}"


def cel_rules(schema: dict[str, Any], where: tuple[str, ...] = ()) -> list[CelRule]:
    """Every CEL rule of a schema, in schema order."""
    found = [
        CelRule(where, i, r["rule"], r.get("message") or f"failed rule: {r['rule']}")
        for i, r in enumerate(schema.get("x-kubernetes-validations", []))
    ]
    for name, sub in schema.get("properties", {}).items():
        found += cel_rules(sub, (*where, name))
    if isinstance(schema.get("items"), dict):
        found += cel_rules(schema["items"], (*where, ITEMS))
    if isinstance(schema.get("additionalProperties"), dict):
        found += cel_rules(schema["additionalProperties"], (*where, VALUES))
    return found


def with_defaults(schema: dict[str, Any], value: Any) -> Any:
    """The value with the schema's defaults filled in, as the API server does before CEL."""
    if isinstance(value, dict):
        out = dict(value)
        for name, sub in schema.get("properties", {}).items():
            if name not in out and "default" in sub:
                out[name] = copy.deepcopy(sub["default"])
            if name in out:
                out[name] = with_defaults(sub, out[name])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            props = schema.get("properties", {})
            out.update({k: with_defaults(extra, v) for k, v in out.items() if k not in props})
        return out
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [with_defaults(schema["items"], v) for v in value]
    return value


def nodes_at(
    value: Any, where: tuple[str, ...], path: tuple[str | int, ...] = ()
) -> Iterator[tuple[tuple[str | int, ...], Any]]:
    """(document path, value) of every node a rule at `where` applies to."""
    if not where:
        yield path, value
        return
    step, rest = where[0], where[1:]
    if step == ITEMS and isinstance(value, list):
        for i, item in enumerate(value):
            yield from nodes_at(item, rest, (*path, i))
    elif step == VALUES and isinstance(value, dict):
        for key, item in value.items():
            yield from nodes_at(item, rest, (*path, key))
    elif isinstance(value, dict) and step in value:
        yield from nodes_at(value[step], rest, (*path, step))


@cache
def program(rule: str) -> Any:
    """The compiled CEL program of a rule (compiled once)."""
    import cel  # loaded when something is rendered, not for a no-op run

    return cel.compile(rule)


def evaluate(rule: CelRule, node: Any) -> str | None:
    """None when the rule holds for the node, else why not (its message, or the error)."""
    try:
        result = program(rule.rule).execute({"self": node})
    except KeyError as err:  # a field the rule reads is absent: the API server's words
        return f"rule could not be evaluated: no such key: {err.args[0] if err.args else err}"
    except Exception as err:  # noqa: BLE001 - the API server refuses an object whose rule errs
        return f"rule could not be evaluated: {err}"
    return None if result is True else rule.message


def check_cel(doc: Document, folder: Path = LLMKUBE_SCHEMAS_DIR) -> list[str]:
    """Every CEL rule of the document's CRD that its values break, one line each."""
    kind = doc.body.get("kind")
    if kind not in known_kinds(folder):
        return []  # layer 1 already names the unknown kind
    schema = operator_schema(kind, folder)
    body = with_defaults(schema.schema, doc.body)
    found = []
    for rule in cel_rules(schema.schema):
        for path, node in nodes_at(body, rule.where):
            why = evaluate(rule, node)
            if why:
                source = schema.source
                if rule.rule in schema.overlay_rules:
                    source = f"{schema.overlay_source} overlay"
                tag = f"[layer 2 CEL rule {rule.name()}, {source}]"
                found.append(violation(doc.file, path, f"{why} {tag}", node))
    return found


def check_admission(doc: Document) -> list[str]:
    """What the operator checks of an InferenceService when it reconciles, not at admission
    (its CRD's CEL rules are check_cel's): the parallel sizes against the GPUs, and one
    member per node."""
    spec = doc.body.get("spec", {})
    vllm = spec.get("vllmConfig") or {}
    product = vllm.get("tensorParallelSize", 1) * vllm.get("pipelineParallelSize", 1)
    gpus = (spec.get("resources") or {}).get("gpu", 0)
    multi = spec.get("multiNode")
    if not multi:
        # One pod: only explicit sizes are checked, and not without a GPU count (the operator
        # derives the sizes from the GPU count, and skips the check when it is unknown).
        explicit = "tensorParallelSize" in vllm or "pipelineParallelSize" in vllm
        if explicit and gpus and product > gpus:
            rule = f"tensorParallelSize x pipelineParallelSize must not exceed gpu = {gpus}"
            return [
                violation(
                    doc.file,
                    ["spec", "vllmConfig", "tensorParallelSize"],
                    f"{rule} [{GUARD}]",
                    product,
                )
            ]
        return []
    found = []
    members = multi.get("members") or []
    if product != len(members) * gpus:  # else the service goes Failed once reconciled
        rule = "tensorParallelSize x pipelineParallelSize must equal members x gpu"
        found.append(
            violation(
                doc.file,
                ["spec", "vllmConfig", "tensorParallelSize"],
                f"{rule} = {len(members) * gpus} [{GUARD}]",
                product,
            )
        )
    seen: dict[str, int] = {}
    for rank, member in enumerate(members):
        node = member.get("node") if isinstance(member, dict) else None
        if isinstance(node, str) and node in seen:
            found.append(
                violation(
                    doc.file,
                    ["spec", "multiNode", "members", rank, "node"],
                    f"members[{seen[node]}] is on this node too: one member per node [{GUARD}]",
                    node,
                )
            )
        elif isinstance(node, str):
            seen[node] = rank
    return found


def check_operator_rules(doc: Document, folder: Path = LLMKUBE_SCHEMAS_DIR) -> list[str]:
    """Layer 2 for one llmkube document: its CRD's CEL rules, then the reconcile-time rules."""
    found = check_cel(doc, folder)
    if doc.body.get("kind") == "InferenceService":
        found += check_admission(doc)
    return found
