"""Provenance: the checks a deploy makes of an image's signed attestation, and `doit
provenance`. The signing itself (in-toto Statements, DSSE envelopes, the keyring) is in
core/signing/, where the images stage signs with it."""

from pipelines.stages.provenance.checks import ImageCheck, check_image
from pipelines.stages.provenance.tasks import ImageTrust, Provenance

__all__ = ["ImageCheck", "ImageTrust", "Provenance", "check_image"]
