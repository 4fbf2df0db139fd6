"""Image attestations made by hand for tests (DSSE's PAE signed with `cryptography`, pushed with
plain HTTP calls under the cosign tag), not with the project's signing code."""

from __future__ import annotations

import base64
import hashlib
import json

import requests
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

IN_TOTO = "application/vnd.in-toto+json"
DSSE = "application/vnd.dsse.envelope.v1+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"


def local_key(world) -> tuple[str, bytes]:
    """(name, 32-byte seed) of the key the world's store signs with (made by its first push)."""
    name, _, encoded = (world["store"] / "keys" / "local-stack.key").read_text().partition(":")
    return name, base64.b64decode(encoded)


def pae(payload: bytes) -> bytes:
    """DSSE's pre-authentication encoding, written out from the DSSE spec."""
    kind = IN_TOTO.encode()
    return b"DSSEv1 %d %b %d %b" % (len(kind), kind, len(payload), payload)


def envelope(statement: dict, keyid: str, seed: bytes) -> bytes:
    """A DSSE envelope of statement signed by the ed25519 seed."""
    payload = json.dumps(statement).encode()
    signature = Ed25519PrivateKey.from_private_bytes(seed).sign(pae(payload))
    return json.dumps(
        {
            "payload": base64.b64encode(payload).decode(),
            "payloadType": IN_TOTO,
            "signatures": [{"keyid": keyid, "sig": base64.b64encode(signature).decode()}],
        }
    ).encode()


def attestation_tag(digest: str) -> str:
    """The cosign convention's tag of digest's attestation."""
    return digest.replace(":", "-") + ".att"


def attached(world, digest: str) -> bytes | None:
    """The envelope under the cosign tag of digest in the world's repository, or None."""
    base = f"http://{world['registry']}/v2/{world['repository']}"
    r = requests.get(
        f"{base}/manifests/{attestation_tag(digest)}",
        headers={"Accept": OCI_MANIFEST},
        timeout=10,
    )
    if r.status_code == 404:
        return None
    manifest = r.json()
    assert manifest["subject"]["digest"] == digest and manifest["artifactType"] == DSSE
    (layer,) = manifest["layers"]
    return requests.get(f"{base}/blobs/{layer['digest']}", timeout=10).content


def attach(world, digest: str, data: bytes) -> None:
    """Put data as the attestation of digest under its cosign tag."""
    base = f"http://{world['registry']}/v2/{world['repository']}"
    descriptors = []
    for media_type, blob in (("application/vnd.oci.empty.v1+json", b"{}"), (DSSE, data)):
        sha = "sha256:" + hashlib.sha256(blob).hexdigest()
        location = requests.post(f"{base}/blobs/uploads/", timeout=10).headers["Location"]
        if location.startswith("/"):
            location = f"http://{world['registry']}{location}"
        sep = "&" if "?" in location else "?"
        requests.put(f"{location}{sep}digest={sha}", data=blob, timeout=10).raise_for_status()
        descriptors.append({"mediaType": media_type, "digest": sha, "size": len(blob)})
    manifest = {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "artifactType": DSSE,
        "config": descriptors[0],
        "layers": [descriptors[1]],
    }
    requests.put(
        f"{base}/manifests/{attestation_tag(digest)}",
        data=json.dumps(manifest).encode(),
        headers={"Content-Type": OCI_MANIFEST},
        timeout=10,
    ).raise_for_status()


def statement_of(data: bytes) -> dict:
    """The Statement an envelope carries (not verified: the test's own reading)."""
    return json.loads(base64.b64decode(json.loads(data)["payload"]))


def vouch_like(world, source: str, digest: str) -> None:
    """Attest digest with the statement of the attested image source, its subject swapped,
    signed by the world's own key: a trusted builder vouching for a test's derived image."""
    data = attached(world, source)
    assert data is not None, f"{source} has no attestation to copy"
    statement = statement_of(data)
    statement["subject"][0]["digest"]["sha256"] = digest.removeprefix("sha256:")
    attach(world, digest, envelope(statement, *local_key(world)))
