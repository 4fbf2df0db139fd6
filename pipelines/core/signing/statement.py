"""The in-toto Statement of an image build: its subject the image digest, its predicate SLSA v1
provenance (who built it, from which commit, from what inputs, when). Pure: no I/O."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

SLSA_PROVENANCE_V1 = "https://slsa.dev/provenance/v1"
# Our own build type (a URN is a URI, as SLSA asks): what externalParameters hold is ours.
IMAGE_BUILD_TYPE = "urn:sparkforge:image-build:v1"
DIGEST = re.compile(r"sha256:[0-9a-f]{64}")


@dataclass(frozen=True)
class ImageBuild:
    """The facts of one image build, as the images stage knows them when it pushes."""

    name: str  # registry/repository the image went to
    digest: str  # sha256:<64 hex>
    key: str  # the image step's key: what `doit plan` computes from the inputs
    material: dict[str, Any]  # the key material: recipe, version, params, inputs, deps
    builder: str  # the CI run, or user@host
    repository: str  # the source repository (GITHUB_REPOSITORY, else the checkout's origin)
    commit: str  # the checkout's git sha
    started: str  # RFC 3339, UTC
    finished: str


def provenance_predicate(build: ImageBuild) -> dict[str, Any]:
    """SLSA v1 provenance of the build: every input the key is made of is a parameter or a
    resolved dependency."""
    material = build.material
    dependencies = [
        {"name": f"input:{name}", "digest": {"sha256": digest}}
        for name, digest in sorted(material.get("inputs", {}).items())
    ]
    for name, value in sorted(material.get("deps", {}).items()):
        hexdigest = value.removeprefix("sha256:")
        dependencies.append({"name": f"dep:{name}", "digest": {"sha256": hexdigest}})
    return {
        "buildDefinition": {
            "buildType": IMAGE_BUILD_TYPE,
            "externalParameters": {
                "image": build.name,
                "key": build.key,
                "recipe": material.get("recipe"),
                "version": material.get("version"),
                "params": material.get("params", {}),
                "source": {"repository": build.repository, "commit": build.commit},
            },
            "resolvedDependencies": dependencies,
        },
        "runDetails": {
            "builder": {"id": build.builder},
            "metadata": {"startedOn": build.started, "finishedOn": build.finished},
        },
    }


def image_statement(build: ImageBuild) -> bytes:
    """The Statement's JSON (the DSSE payload), made and validated by the in-toto bindings."""
    # Imported here, where a Statement is made: listing tasks needs neither.
    from google.protobuf import json_format
    from in_toto_attestation.v1.resource_descriptor import ResourceDescriptor
    from in_toto_attestation.v1.statement import Statement

    if not DIGEST.fullmatch(build.digest):
        raise ValueError(f"image digest {build.digest!r}: expected sha256:<64 hex>")
    subject = ResourceDescriptor(name=build.name, digest={"sha256": build.digest[7:]})
    predicate = provenance_predicate(build)
    statement = Statement([subject.pb], SLSA_PROVENANCE_V1, predicate)
    statement.validate()
    as_dict = json_format.MessageToDict(statement.pb)
    # The predicate as given, not as protobuf's Struct returns it (every number a float: the
    # params would no longer give the key they were hashed into).
    as_dict["predicate"] = predicate
    return json.dumps(as_dict, sort_keys=True, separators=(",", ":")).encode()
