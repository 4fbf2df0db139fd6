"""What deploy checks of an image's attestation before it touches any member; each failed
check is one line. Pure: the attestation's bytes come from the registry at the edge."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipelines.core.signing.envelope import Opened, Unverified, open_envelope
from pipelines.core.signing.namedkeys import PublicKey
from pipelines.core.signing.statement import SLSA_PROVENANCE_V1


@dataclass(frozen=True)
class ImageCheck:
    """One image's attestation, judged: the problem (None when every check passes) and what
    the attestation says (None when it could not be read)."""

    ref: str  # registry/repository@sha256:...
    problem: str | None
    opened: Opened | None = None

    @property
    def predicate(self) -> dict[str, Any]:
        """The SLSA provenance of a verified attestation (empty when none)."""
        predicate = self.opened.statement.get("predicate") if self.opened else None
        return predicate if isinstance(predicate, dict) else {}


def subject_digests(statement: dict[str, Any]) -> list[str]:
    """The sha256 digests a Statement names as its subjects (hostile: anything else skipped)."""
    subjects = statement.get("subject")
    found = []
    for subject in subjects if isinstance(subjects, list) else []:
        digest = subject.get("digest") if isinstance(subject, dict) else None
        value = digest.get("sha256") if isinstance(digest, dict) else None
        if isinstance(value, str):
            found.append(f"sha256:{value}")
    return found


def recorded_key(statement: dict[str, Any]) -> Any:
    """The inputs key the provenance records (externalParameters.key), or None."""
    predicate = statement.get("predicate")
    definition = predicate.get("buildDefinition") if isinstance(predicate, dict) else None
    params = definition.get("externalParameters") if isinstance(definition, dict) else None
    return params.get("key") if isinstance(params, dict) else None


def check_image(
    ref: str, envelope: bytes | None, key_now: str, trusted: dict[str, PublicKey]
) -> ImageCheck:
    """Judge an image's attestation: present, signed by a trusted key, about this digest, and
    made from the inputs whose key this checkout computes now."""
    digest = ref.rpartition("@")[2]
    if envelope is None:
        return ImageCheck(ref, f"image {ref}: no attestation in the registry (unattested build)")
    try:
        opened = open_envelope(envelope, trusted)
    except Unverified as err:
        return ImageCheck(ref, f"image {ref}: attestation refused: {err}")
    statement = opened.statement
    if statement.get("predicateType") != SLSA_PROVENANCE_V1:
        kind = str(statement.get("predicateType"))[:80]
        problem = f"image {ref}: attestation predicate {kind!r}, expected {SLSA_PROVENANCE_V1}"
        return ImageCheck(ref, problem, opened)
    subjects = subject_digests(statement)
    if digest not in subjects:
        named = ", ".join(s[:19] for s in subjects[:3]) or "none"
        problem = f"image {ref}: attestation is about {named}, not the digest deployed"
        return ImageCheck(ref, problem, opened)
    key = recorded_key(statement)
    if key != key_now:
        shown = key[:16] if isinstance(key, str) else "none"
        problem = (
            f"image {ref}: attestation records inputs key {shown}, this checkout computes"
            f" {key_now[:16]} (`doit plan`): built from other inputs or another commit"
        )
        return ImageCheck(ref, problem, opened)
    return ImageCheck(ref, None, opened)
