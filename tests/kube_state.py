"""Test equipment: the API double's state (objects, scripts, requests) and what an apply does
to it: strict validation against the derived CRD schemas, no-op re-applies, immutable Job
templates, scripted statuses (one step per read). tests/kube_api.py serves it over HTTP."""

from __future__ import annotations

import base64
import copy
import threading
from dataclasses import dataclass, field
from typing import Any

import yaml

from pipelines.stages.render.crd_schema import validator

LLMKUBE = "inference.llmkube.dev/v1alpha1"
TOKEN = "double-token-7f3a"
# (apiVersion, kind, plural, namespaced): every kind the backend reads or applies.
RESOURCES = [
    ("v1", "Namespace", "namespaces", False),
    ("v1", "Node", "nodes", False),
    ("v1", "PersistentVolume", "persistentvolumes", False),
    ("v1", "PersistentVolumeClaim", "persistentvolumeclaims", True),
    ("v1", "ConfigMap", "configmaps", True),
    ("v1", "Pod", "pods", True),
    ("v1", "Secret", "secrets", True),
    ("batch/v1", "Job", "jobs", True),
    (LLMKUBE, "Model", "models", True),
    (LLMKUBE, "InferenceService", "inferenceservices", True),
]
BY_PATH = {(v, p): (k, ns) for v, k, p, ns in RESOURCES}
SERVER_METADATA = ("uid", "resourceVersion", "generation", "creationTimestamp", "managedFields")


def b64(value: str) -> str:
    """A value as a Secret's data holds it."""
    return base64.b64encode(value.encode()).decode()


def status(code: int, reason: str, message: str, **details: Any) -> dict[str, Any]:
    """A metav1.Status body, as the API server answers errors."""
    body = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code}
    body.update(reason=reason, message=message)
    if details:
        body["details"] = details
    return body


def job_status(state: str, message: str = "") -> dict[str, Any]:
    """A Job's status: Running, Complete or Failed."""
    if state == "Running":
        return {"active": 1}
    condition = {"type": state, "status": "True", "message": message}
    return {"conditions": [condition], ("succeeded" if state == "Complete" else "failed"): 1}


def service_status(phase: str, ready: int, size: int = 3, generation: int | None = None) -> dict:
    """An InferenceService's status; generation None: of whatever spec is stored."""
    condition = {"type": "MultiNodeGroupReady", "status": "True" if phase == "Ready" else "False"}
    condition.update(reason=phase, message=f"{ready}/{size} members ready")
    if generation is not None:
        condition["observedGeneration"] = generation
    return {
        "phase": phase,
        "multiNode": {"size": size, "readyMembers": ready},
        "conditions": [condition],
    }


# Status scripts by kind: one step per read of the object, the last one kept.
DEFAULT_SCRIPTS: dict[str, list[dict[str, Any]]] = {
    "Job": [job_status("Running"), job_status("Complete")],
    "Model": [{"phase": "Downloading"}, {"phase": "Ready"}],
    "InferenceService": [
        service_status("Creating", 0),
        service_status("Progressing", 1),
        service_status("Ready", 3),
    ],
}


@dataclass
class Request:
    """One request as the double saw it (the Authorization header left out)."""

    method: str
    path: str
    query: dict[str, str]
    content_type: str
    body: str
    code: int = 0


@dataclass
class KubeDouble:
    """The double's state and scripts; tests change them between or during calls."""

    objects: dict[tuple[str, str, str | None, str], dict[str, Any]] = field(default_factory=dict)
    requests: list[Request] = field(default_factory=list)
    events: list[str] = field(default_factory=list)  # applies, deletes and statuses served
    scripts: dict[tuple[str, str], list[dict[str, Any]]] = field(default_factory=dict)
    logs: dict[str, str] = field(default_factory=dict)  # Job name -> its pod's log
    refuse: dict[tuple[str, str], int] = field(default_factory=dict)  # (method, path part)
    token: str = TOKEN
    secret_values: list[str] = field(default_factory=list)  # must never arrive in a body
    leaks: list[str] = field(default_factory=list)  # requests that carried one (refused)
    version: int = 100
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, body: dict[str, Any]) -> None:
        """An object that exists before the test (a namespace, a node, an earlier deploy)."""
        meta = body["metadata"]
        key = (body["apiVersion"], body["kind"], meta.get("namespace"), meta["name"])
        self.version += 1
        meta.update(resourceVersion=str(self.version), generation=1, uid=f"uid-{self.version}")
        self.objects[key] = body

    def find(self, kind: str, name: str) -> dict[str, Any] | None:
        """The stored object of a kind and name."""
        for (_, k, _, n), body in self.objects.items():
            if k == kind and n == name:
                return body
        return None

    def script(self, kind: str, name: str, steps: list[dict[str, Any]]) -> None:
        """The statuses an object shows on its next reads (from its next creation or now)."""
        self.scripts[(kind, name)] = [copy.deepcopy(s) for s in steps]
        body = self.find(kind, name)
        if body is not None:
            body["_script"] = [copy.deepcopy(s) for s in steps]

    def writes(self) -> list[Request]:
        """The requests that could change state (dry runs included)."""
        return [r for r in self.requests if r.method in ("PATCH", "PUT", "POST", "DELETE")]

    def applied(self) -> list[str]:
        """kind/name of every stored apply and delete, in order."""
        return [e for e in self.events if e.startswith(("apply ", "delete "))]


def read(d: KubeDouble, key: tuple, plural: str):
    """GET of one object: its next scripted status, then the object."""
    body = d.objects.get(key)
    if body is None:
        return 404, status(404, "NotFound", f'{plural} "{key[3]}" not found')
    steps = body.get("_script")
    if steps:
        step = steps.pop(0) if len(steps) > 1 else steps[0]
        body["status"] = copy.deepcopy(step)
        for condition in body["status"].get("conditions", []):
            if key[1] == "InferenceService":  # written for the stored spec, unless scripted
                condition.setdefault("observedGeneration", body["metadata"]["generation"])
        d.events.append(f"status {key[1]}/{key[3]} {summary(body['status'])}")
    return 200, {k: v for k, v in body.items() if not k.startswith("_")}


def summary(st: dict[str, Any]) -> str:
    """A status in a word or two, for the event log."""
    if "phase" in st:
        ready = st.get("multiNode", {}).get("readyMembers")
        return st["phase"] + (f" {ready}" if ready is not None else "")
    conditions = [c["type"] for c in st.get("conditions", [])]
    return conditions[0] if conditions else "Running"


def list_objects(d: KubeDouble, kind: str, namespace: str | None, selector: str) -> dict:
    """LIST; pods are made up from the Jobs (one pod each, labelled job-name)."""
    items = []
    if kind == "Pod":
        for (_, k, ns, name), _body in d.objects.items():
            if k == "Job" and ns == namespace:
                pod = {"metadata": {"name": f"{name}-x7k2p", "namespace": ns}}
                pod["metadata"]["labels"] = {"job-name": name}
                items.append(pod)
    else:
        items = [b for (_, k, ns, _), b in d.objects.items() if k == kind and ns == namespace]
    for requirement in filter(None, selector.split(",")):
        items = [i for i in items if selects(requirement, i["metadata"].get("labels", {}))]
    return {"kind": f"{kind}List", "apiVersion": "v1", "items": items}


def selects(requirement: str, labels: dict[str, str]) -> bool:
    """One requirement of a label selector as the API server reads it: `key=value`,
    `key==value`, `key!=value` (true without the key too), `!key`, `key`."""
    if requirement.startswith("!"):
        return requirement[1:] not in labels
    if "!=" in requirement:
        label, value = requirement.split("!=", 1)
        return labels.get(label) != value
    if "=" in requirement:
        label, value = requirement.replace("==", "=", 1).split("=", 1)
        return labels.get(label) == value
    return requirement in labels


def strict_errors(kind: str, body: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(unknown fields, other schema violations) of an llmkube object."""
    unknown, invalid = [], []
    for error in validator(kind).iter_errors(body):
        where = ".".join(str(p) for p in error.absolute_path)
        if error.validator == "additionalProperties":
            extra = set(error.instance) - set(error.schema.get("properties", {}))
            unknown += [f".{where}.{name}".replace("..", ".") for name in sorted(extra)]
        else:
            invalid.append(f"{where}: {error.message}")
    return unknown, invalid


def apply(d: KubeDouble, key: tuple, plural: str, query: dict, ctype: str, raw: str):
    """A server-side apply patch: validated, stored (unless dry run), the object returned."""
    version, kind, namespace, name = key
    if ctype != "application/apply-patch+yaml":
        return 415, status(
            415, "UnsupportedMediaType", f"the double takes apply patches, not {ctype}"
        )
    if not query.get("fieldManager"):
        message = 'PatchOptions.meta.k8s.io "" is invalid: fieldManager: Required value'
        return 422, status(422, "Invalid", message)
    body = yaml.load(raw, Loader=yaml.CSafeLoader)  # JSON is YAML; libyaml parses it fast
    meta = body.get("metadata", {})
    if (body.get("apiVersion"), body.get("kind"), meta.get("name")) != (version, kind, name):
        return 400, status(
            400, "BadRequest", "the body's apiVersion, kind or name differs from the URL"
        )
    if namespace is not None and meta.get("namespace", namespace) != namespace:
        return 400, status(400, "BadRequest", "the body's namespace differs from the URL's")
    if version == LLMKUBE:
        unknown, invalid = strict_errors(kind, body)
        if unknown:
            # What an API server says to a strict apply: 400 BadRequest, the fields named.
            message = "; ".join(f"{f}: field not declared in schema" for f in unknown)
            causes = [{"reason": "FieldValueInvalid", "field": f} for f in unknown]
            return 400, status(400, "BadRequest", message, causes=causes)
        if invalid:
            message = f'{kind}.{version.split("/")[0]} "{name}" is invalid: ' + "; ".join(invalid)
            return 422, status(422, "Invalid", message)
    current = d.objects.get(key)
    if (
        current is not None
        and kind == "Job"
        and current["spec"]["template"] != body["spec"]["template"]
    ):
        message = f'Job.batch "{name}" is invalid: spec.template: Invalid value: field is immutable'
        return 422, status(422, "Invalid", message)
    stored = merged(d, current, body, key)
    if query.get("dryRun") == "All":
        return 200, {k: v for k, v in stored.items() if not k.startswith("_")}
    if stored is not current:
        d.objects[key] = stored
        d.events.append(f"apply {kind}/{name}")
    return (201 if current is None else 200), {
        k: v for k, v in stored.items() if not k.startswith("_")
    }


def merged(d: KubeDouble, current: dict | None, body: dict, key: tuple) -> dict[str, Any]:
    """The object after the apply; current itself when the apply changes nothing."""
    if current is not None:
        mine = {k: v for k, v in current.items() if k not in ("status",) and not k.startswith("_")}
        mine["metadata"] = {
            k: v for k, v in current["metadata"].items() if k not in SERVER_METADATA
        }
        if mine == body:
            return current
    stored = copy.deepcopy(body)
    d.version += 1
    meta = stored["metadata"]
    meta["resourceVersion"] = str(d.version)
    if current is None:
        meta.update(generation=1, uid=f"uid-{d.version}", creationTimestamp="2026-11-30T00:00:00Z")
        steps = d.scripts.get((key[1], key[3]), DEFAULT_SCRIPTS.get(key[1]))
        if steps:
            stored["_script"] = copy.deepcopy(steps)
    else:
        same_spec = current.get("spec") == body.get("spec")
        old = current["metadata"]
        meta.update(uid=old["uid"], creationTimestamp=old.get("creationTimestamp"))
        meta["generation"] = old["generation"] + (0 if same_spec else 1)
        for k in ("status", "_script"):
            if k in current:
                stored[k] = current[k]
        if not same_spec and key[1] in DEFAULT_SCRIPTS:  # a new spec plays its script again
            stored["_script"] = copy.deepcopy(
                d.scripts.get((key[1], key[3]), DEFAULT_SCRIPTS[key[1]])
            )
    return stored
