"""Layer 4: core kinds against Kubernetes' own schemas (the strict ones kubernetes-validate
ships), each kind's validator made once per process: its definitions file is 1.4 MB of JSON,
which kubernetes-validate's own `validate` parses again for every document."""

from __future__ import annotations

import re
from functools import cache
from typing import Any

from pipelines.stages.render.documents import Document
from pipelines.stages.render.violations import violation

K8S_VERSION = "1.33"


@cache
def schema_folder(version: str = K8S_VERSION) -> str:
    """The strict schemas' folder of the newest release the package has at or below version."""
    from kubernetes_validate import utils

    wanted = utils.major_minor(version)
    if utils.major_minor(utils.latest_version()) < wanted:
        raise utils.VersionNotSupportedError(version=wanted)
    newest = [v for v in utils.all_versions() if utils.major_minor(v) <= wanted][-1]
    return f"kubernetes-json-schema/v{newest}-local-strict"


@cache
def definitions(version: str = K8S_VERSION) -> Any:
    """The shared definitions every core schema refers to, as a referencing registry."""
    from kubernetes_validate import utils
    from referencing import Registry, Resource

    contents = utils.schema_contents(f"{schema_folder(version)}/_definitions.json", version)
    registry: Any = Resource.from_contents(contents) @ Registry()
    return registry


@cache
def core_validator(api_version: str, kind: str, version: str = K8S_VERSION) -> Any:
    """The Draft 2020-12 validator of one core kind, as kubernetes-validate names its file."""
    import jsonschema
    from kubernetes_validate import utils
    from referencing import Resource

    # rbac.authorization.k8s.io/v1 -> rbac-v1; v1 -> v1
    group = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    name = f"{schema_folder(version)}/{kind.lower()}-{group}.json"
    try:
        schema = utils.schema_contents(name, version)
    except FileNotFoundError:
        raise utils.SchemaNotFoundError(
            kind=kind, version=utils.major_minor(version), api_version=api_version
        ) from None
    registry = Resource.from_contents(schema) @ definitions(version)
    return jsonschema.Draft202012Validator(schema, registry=registry)


def check_core_schema(doc: Document) -> list[str]:
    """The first violation of a core kind's document, as kubernetes-validate reports it."""
    found = core_validator(str(doc.body.get("apiVersion")), str(doc.body.get("kind")))
    error = next(iter(found.iter_errors(doc.body)), None)
    if error is None:
        return []
    return [violation(doc.file, error.absolute_path, error.message, error.instance)]
