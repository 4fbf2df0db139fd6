"""Provenance: signed in-toto attestations (SLSA v1) of what is built, and the checks a deploy
makes of them. Imports no stage: the images stage signs with it, dodo.py hands the deploy its
checks."""

from pipelines.provenance.checks import ImageCheck, check_image
from pipelines.provenance.envelope import Opened, Unverified, open_envelope, sign_statement
from pipelines.provenance.keyring import attestation_signer, deploy_trusted
from pipelines.provenance.statement import ImageBuild, image_statement
from pipelines.provenance.tasks import ImageTrust, Provenance

__all__ = [
    "ImageBuild",
    "ImageCheck",
    "ImageTrust",
    "Opened",
    "Provenance",
    "Unverified",
    "attestation_signer",
    "check_image",
    "deploy_trusted",
    "image_statement",
    "open_envelope",
    "sign_statement",
]
