"""Kubernetes objects as the Kubernetes backend handles them: pure functions, no API calls."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any

from pipelines.stages.deploy.fielddiff import shown_type

LAST_APPLIED = "sparkforge.dev/last-applied"
# Metadata the API server writes; a configuration to re-apply must not carry it.
SERVER_METADATA = (
    "uid",
    "resourceVersion",
    "generation",
    "creationTimestamp",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "managedFields",
    "selfLink",
)


def compact(body: dict[str, Any]) -> str:
    """A configuration as one canonical JSON line (what the annotation holds)."""
    return json.dumps(body, sort_keys=True, separators=(",", ":"))


def with_last_applied(config: dict[str, Any]) -> dict[str, Any]:
    """The configuration as applied: itself, plus itself in the last-applied annotation."""
    body = copy.deepcopy(config)
    annotations = body["metadata"].setdefault("annotations", {})
    annotations[LAST_APPLIED] = compact(config)
    return body


def object_name(doc: dict[str, Any]) -> str:
    """Kind/name, and where it lives: how a line names an object."""
    meta = doc["metadata"]
    where = f" in {meta['namespace']}" if meta.get("namespace") else ""
    return f"{doc['kind']}/{meta['name']}{where}"


def applied_differs(current: dict[str, Any], body: dict[str, Any]) -> bool:
    """Whether the server's object was last applied with another configuration than body's."""
    ours: str = body["metadata"]["annotations"][LAST_APPLIED]
    theirs: str | None = current["metadata"].get("annotations", {}).get(LAST_APPLIED)
    return theirs != ours


def owned(config: dict[str, Any], label: str, value: str) -> dict[str, Any]:
    """The configuration with the ownership label set (what pruning selects by)."""
    body = copy.deepcopy(config)
    body["metadata"].setdefault("labels", {})[label] = value
    return body


def compared(body: dict[str, Any]) -> dict[str, Any]:
    """An object as diffs compare it: no status, no server-written metadata, no last-applied
    annotation (it repeats the rest)."""
    config = {k: v for k, v in body.items() if k != "status"}
    meta = {k: v for k, v in body.get("metadata", {}).items() if k not in SERVER_METADATA}
    annotations = {k: v for k, v in meta.get("annotations", {}).items() if k != LAST_APPLIED}
    meta.pop("annotations", None)
    if annotations:
        meta["annotations"] = annotations
    config["metadata"] = meta
    return config


def kept_document_problems(documents: tuple[dict[str, Any], ...]) -> list[str]:
    """One line per kept document without what applying it reads: apiVersion, kind and
    metadata.name strings (a namespace, when there, a string too); no Secret."""
    problems = []
    for i, doc in enumerate(documents):
        where = f"deployment.documents[{i}]"
        if not isinstance(doc, dict):
            problems.append(f"{where}: expected a Kubernetes object")
            continue
        for name in ("apiVersion", "kind"):
            if not isinstance(doc.get(name), str) or not doc[name]:
                problems.append(
                    f"{where}.{name}: expected a string, found {shown_type(doc.get(name))}"
                )
        meta = doc.get("metadata")
        if not isinstance(meta, dict):
            problems.append(f"{where}.metadata: expected an object, found {shown_type(meta)}")
            continue
        if not isinstance(meta.get("name"), str) or not meta["name"]:
            problems.append(
                f"{where}.metadata.name: expected a string, found {shown_type(meta.get('name'))}"
            )
        namespace = meta.get("namespace", "")
        if not isinstance(namespace, str):
            problems.append(
                f"{where}.metadata.namespace: expected a string, found {shown_type(namespace)}"
            )
        if doc.get("kind") == "Secret":
            problems.append(f"{where}.kind: Secret; expected Secrets by name only")
        problems += [f"{where}.{line}" for line in kind_problems(doc)]
    return problems


def kind_problems(doc: dict[str, Any]) -> list[str]:
    """What apply and its waits read of a Job (its first container's name) or an
    InferenceService (its spec), where missing or of another type."""
    spec = doc.get("spec")
    if doc.get("kind") == "InferenceService" and not isinstance(spec, dict):
        return [f"spec: expected an object, found {shown_type(spec)}"]
    if doc.get("kind") != "Job":
        return []
    try:
        name = spec["template"]["spec"]["containers"][0]["name"]  # type: ignore[index]
    except (KeyError, IndexError, TypeError):
        name = None
    if not isinstance(name, str):
        return ["spec.template.spec.containers[0].name: expected a string"]
    return []


def previous_config(current: dict[str, Any]) -> dict[str, Any]:
    """What to re-apply to get an object back: sparkforge's last configuration, else the object
    without status and server-written metadata (it was made by someone else)."""
    meta = current.get("metadata", {})
    kept = meta.get("annotations", {}).get(LAST_APPLIED)
    if kept:
        last: dict[str, Any] = json.loads(kept)
        return last
    config = {k: v for k, v in current.items() if k != "status"}
    config["metadata"] = {k: v for k, v in meta.items() if k not in SERVER_METADATA}
    return config


def phase_of(doc: dict[str, Any]) -> str:
    """The apply phase of a document; Jobs running the same container are one phase."""
    kind: str = doc["kind"]
    if kind == "Job":
        container: str = doc["spec"]["template"]["spec"]["containers"][0]["name"]
        return "jobs " + container
    if kind in ("ConfigMap", "PersistentVolume", "PersistentVolumeClaim"):
        return "caches"
    return kind


def phases(documents: tuple[dict[str, Any], ...]) -> list[tuple[str, list[dict[str, Any]]]]:
    """(phase, documents) in apply order: consecutive documents of one phase together."""
    found: list[tuple[str, list[dict[str, Any]]]] = []
    for doc in documents:
        name = phase_of(doc)
        if found and found[-1][0] == name:
            found[-1][1].append(doc)
        else:
            found.append((name, [doc]))
    return found


@dataclass
class Change:
    """What apply did to one object, so that restore can undo exactly that."""

    api_version: str
    kind: str
    name: str
    namespace: str | None
    before: dict[str, Any] | None  # the configuration to re-apply; None: it did not exist
    replaced: bool = False  # a Job deleted and created anew (a Job's template cannot change)
    unchanged: bool = False

    def line(self, dry_run: bool) -> str:
        """What happened to the object, in a few words."""
        if self.unchanged:
            did = "unchanged"
        elif self.replaced:
            did = "replaced"
        else:
            did = "configured" if self.before is not None else "created"
        where = f" in {self.namespace}" if self.namespace else ""
        return f"{self.kind}/{self.name}{where} {did}" + (" (server dry run)" if dry_run else "")


# Render labels the ring staging objects so: their Jobs run the weights-stager image, not the
# runtime image the deployment promotes.
STAGING_LABEL = ("app.kubernetes.io/component", "weights-staging")


def images_of(doc: dict[str, Any]) -> set[str]:
    """The runtime images a document runs (an InferenceService's, a Job's containers')."""
    labels = doc.get("metadata", {}).get("labels", {})
    if labels.get(STAGING_LABEL[0]) == STAGING_LABEL[1]:
        return set()
    if doc["kind"] == "InferenceService":
        return {doc["spec"]["image"]}
    if doc["kind"] == "Job":
        return {c["image"] for c in doc["spec"]["template"]["spec"]["containers"]}
    return set()


def job_state(job: dict[str, Any]) -> tuple[str, str]:
    """(Complete | Failed | Running, the condition's message) of a Job."""
    for condition in job.get("status", {}).get("conditions", []):
        if condition.get("type") in ("Complete", "Failed") and condition.get("status") == "True":
            return condition["type"], condition.get("message", "")
    return "Running", ""


def service_state(service: dict[str, Any], members: int) -> tuple[str, str]:
    """(Ready | Failed | Waiting, in a few words) of an InferenceService of this generation."""
    status = service.get("status", {})
    phase = status.get("phase") or "no phase yet"
    ready = status.get("multiNode", {}).get("readyMembers", 0)
    said = f"phase {phase}, {ready}/{members} members ready"
    conditions = status.get("conditions", [])
    generation = service.get("metadata", {}).get("generation")
    seen = [c["observedGeneration"] for c in conditions if "observedGeneration" in c]
    # A status the operator wrote for the previous spec says nothing about this one.
    if seen and generation is not None and max(seen) < generation:
        return "Waiting", f"{said}, status of generation {max(seen)} < {generation}"
    if phase == "Failed":
        messages = [c.get("message", "") for c in conditions if c.get("status") == "False"]
        return "Failed", "; ".join(m for m in messages if m) or said
    if phase == "Ready" and ready == members:
        return "Ready", said
    return "Waiting", said
