"""DSSE envelopes of in-toto Statements, signed and verified with named ed25519 keys through
securesystemslib (the envelope's keyid is the key's name)."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pipelines.core.s3 import held_back
from pipelines.core.signing.namedkeys import PublicKey, SigningKey

# securesystemslib is imported where an envelope is made or opened, not when tasks are listed.
if TYPE_CHECKING:
    from securesystemslib.signer import SSlibKey

IN_TOTO_PAYLOAD = "application/vnd.in-toto+json"
# An envelope is a few kilobytes; anything far bigger is not one of ours.
MAX_ENVELOPE_BYTES = 1 << 20


class Unverified(Exception):
    """An envelope that is not a trusted signature of an in-toto Statement (the reason)."""


@dataclass(frozen=True)
class Opened:
    """A verified envelope: the Statement it carries and the name of the key that signed it."""

    statement: dict[str, Any]
    signer: str


def load_securesystemslib() -> None:
    """securesystemslib's signer package loaded without boto3: it imports every signer it
    offers, its AWS KMS one with boto3 (some 0.15 CPU s at the start of every deploy that
    checks an attestation) where boto3 is installed, as it is here for S3. Held back, that
    signer is unavailable, as the library leaves it where boto3 is missing; ours are ed25519."""
    if "securesystemslib.signer" not in sys.modules:
        with held_back("boto3"):
            import securesystemslib.signer  # noqa: F401


def sslib_key(key: PublicKey) -> SSlibKey:
    """The securesystemslib form of a named key (its keyid is the name)."""
    load_securesystemslib()
    from securesystemslib.signer import SSlibKey

    return SSlibKey.from_crypto(key.key, keyid=key.name)


def sign_statement(payload: bytes, key: SigningKey) -> bytes:
    """The DSSE envelope (JSON) of a Statement's JSON, signed by key."""
    load_securesystemslib()
    from securesystemslib.dsse import Envelope
    from securesystemslib.signer import CryptoSigner

    envelope = Envelope(payload, IN_TOTO_PAYLOAD, {})
    envelope.sign(CryptoSigner(key.key, sslib_key(key.public)))
    return json.dumps(envelope.to_dict(), sort_keys=True).encode()


def open_envelope(data: bytes, trusted: dict[str, PublicKey]) -> Opened:
    """The Statement of an envelope one trusted key signed, or Unverified with the reason."""
    load_securesystemslib()
    from securesystemslib.dsse import Envelope
    from securesystemslib.exceptions import VerificationError

    if len(data) > MAX_ENVELOPE_BYTES:
        raise Unverified(f"{len(data)} bytes, over the {MAX_ENVELOPE_BYTES} an envelope may be")
    try:
        envelope = Envelope.from_dict(json.loads(data))
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
        raise Unverified("not a DSSE envelope (unreadable JSON or fields)") from None
    if envelope.payload_type != IN_TOTO_PAYLOAD:
        raise Unverified(f"payload type {envelope.payload_type!r}, expected {IN_TOTO_PAYLOAD}")
    names = sorted(envelope.signatures)
    known = [trusted[name] for name in names if name in trusted]
    if not known:
        shown = ", ".join(repr(n[:64]) for n in names[:5]) or "no key"
        raise Unverified(f"signed by {shown}, not a trusted key")
    try:
        accepted = envelope.verify([sslib_key(k) for k in known], 1)
    except VerificationError:
        raise Unverified(
            f"signature by {', '.join(k.name for k in known)} does not verify (forged or altered)"
        ) from None
    try:
        statement = json.loads(envelope.payload)
    except (ValueError, RecursionError):
        raise Unverified("signed payload is not JSON") from None
    if not isinstance(statement, dict):
        raise Unverified("signed payload is not a Statement object")
    return Opened(statement, sorted(accepted)[0])
