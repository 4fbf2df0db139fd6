"""Attestations beside an image in its registry: an OCI 1.1 artifact manifest whose subject is
the image and whose one layer is the DSSE envelope, tagged by the cosign convention
`sha256-<hex>.att`, and found through the referrers API where the registry has one (the local
stack's registry, distribution 2.8, has none: its referrers URL answers 404)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from pipelines.core.progress import NoProgress
from pipelines.stages.images.oci import MANIFEST_TYPE
from pipelines.stages.images.registry import Registry
from pipelines.stages.images.registry_push import push_blob
from pipelines.stages.images.spec import ImageError

DSSE_TYPE = "application/vnd.dsse.envelope.v1+json"
EMPTY_TYPE = "application/vnd.oci.empty.v1+json"
EMPTY = b"{}"  # the OCI empty descriptor's bytes: the config of an artifact without one
MAX_ENVELOPE_BYTES = 1 << 20
MAX_MANIFEST_BYTES = 1 << 16


def attestation_tag(digest: str) -> str:
    """The cosign convention's tag of an image's attestation: `sha256-<hex>.att`."""
    return digest.replace(":", "-", 1) + ".att"


def descriptor(media_type: str, data: bytes) -> dict[str, Any]:
    """The OCI descriptor of some bytes."""
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    return {"mediaType": media_type, "digest": digest, "size": len(data)}


def attestation_manifest(subject: dict[str, Any], envelope: bytes) -> bytes:
    """The artifact manifest of an envelope about subject (the image's descriptor)."""
    manifest = {
        "schemaVersion": 2,
        "mediaType": MANIFEST_TYPE,
        "artifactType": DSSE_TYPE,
        "config": descriptor(EMPTY_TYPE, EMPTY),
        "layers": [descriptor(DSSE_TYPE, envelope)],
        "subject": subject,
    }
    return json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()


def attach(registry: Registry, repo: str, digest: str, envelope: bytes, work: Path) -> str:
    """Push the envelope beside the image digest (blobs, then the manifest under its tag);
    returns the attestation manifest's digest."""
    found = registry.manifest(repo, digest)
    if found is None:
        raise ImageError(f"registry {registry.host}: {repo}@{digest} is not there to attest")
    image, media_type = found
    subject = {**descriptor(media_type, image), "digest": digest}
    for data in (EMPTY, envelope):  # a few kilobytes: no progress to show
        path = work / f"attestation-{hashlib.sha256(data).hexdigest()[:16]}"
        path.write_bytes(data)
        push_blob(registry, repo, descriptor("", data)["digest"], path, NoProgress())
    manifest = attestation_manifest(subject, envelope)
    return registry.push_manifest(repo, attestation_tag(digest), manifest, MANIFEST_TYPE)


def envelope_of(registry: Registry, repo: str, manifest_ref: str) -> bytes | None:
    """The DSSE envelope an attestation manifest carries (hostile: checked), None if absent."""
    found = registry.manifest(repo, manifest_ref)
    if found is None:
        return None
    data, _ = found
    where = f"registry {registry.host}: attestation {repo}:{manifest_ref[:80]}"
    if len(data) > MAX_MANIFEST_BYTES:
        raise ImageError(f"{where}: manifest over {MAX_MANIFEST_BYTES} bytes")
    try:
        layers = json.loads(data)["layers"]
        layer = next(x for x in layers if x["mediaType"] == DSSE_TYPE)
        digest, size = layer["digest"], layer["size"]
    except (ValueError, TypeError, KeyError, StopIteration, RecursionError):
        raise ImageError(f"{where}: not an attestation manifest (no DSSE layer)") from None
    if not isinstance(digest, str) or not digest.startswith("sha256:") or not isinstance(size, int):
        raise ImageError(f"{where}: its DSSE layer has no sha256 digest or size")
    return registry.small_blob(repo, digest, MAX_ENVELOPE_BYTES)


def find_attestation(registry: Registry, repo: str, digest: str) -> bytes | None:
    """The envelope attached to an image: through the referrers API when the registry has
    one, else under the cosign tag; None when the image has none."""
    referring = registry.referrers(repo, digest, DSSE_TYPE)
    if referring:
        # The newest last (registries list in push order): a re-attested image's latest.
        digests = [m.get("digest") for m in referring if isinstance(m, dict)]
        refs = [d for d in digests if isinstance(d, str) and d.startswith("sha256:")]
        if refs:
            return envelope_of(registry, repo, refs[-1])
    return envelope_of(registry, repo, attestation_tag(digest))
