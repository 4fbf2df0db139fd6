"""ed25519 keys and signatures of the remote cache's entry indexes."""

from __future__ import annotations

import base64
import binascii
import os
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from pipelines.errors import BadInput

# Domain separation: an index signature can never be taken for a signature of anything else.
CONTEXT = b"sparkforge-remote-cache-index-v1\0"
SIGNING_ENV = "SPARKFORGE_CACHE_SIGNING_KEY"
TRUSTED_ENV = "SPARKFORGE_CACHE_TRUSTED_KEYS"


def signing_key(text: str) -> Ed25519PrivateKey:
    """The private key from SPARKFORGE_CACHE_SIGNING_KEY: PEM (PKCS#8) or base64 of 32 raw bytes.

    Errors never quote the value: it is a secret.
    """
    expected = (
        f"environment {SIGNING_ENV}: expected an ed25519 private key"
        " (PEM, or base64 of its 32 raw bytes)"
    )
    text = text.strip()
    try:
        if text.startswith("-----BEGIN"):
            key = serialization.load_pem_private_key(text.encode(), password=None)
        else:
            key = Ed25519PrivateKey.from_private_bytes(base64.b64decode(text, validate=True))
    except (ValueError, TypeError, binascii.Error):
        raise BadInput(expected) from None
    if not isinstance(key, Ed25519PrivateKey):
        raise BadInput(expected)
    return key


def public_key(text: str, where: str = TRUSTED_ENV) -> Ed25519PublicKey:
    """A trusted key: base64 of the 32 raw bytes of an ed25519 public key."""
    try:
        raw = base64.b64decode(text.strip(), validate=True)
        return Ed25519PublicKey.from_public_bytes(raw)
    except (ValueError, binascii.Error):
        raise BadInput(
            f"{where}: {text.strip()!r} is not an ed25519 public key (base64 of 32 raw bytes)"
        ) from None


def public_text(key: Ed25519PublicKey) -> str:
    """The base64 of a public key's 32 raw bytes (how keys are named and trusted)."""
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return base64.b64encode(raw).decode()


def trusted_keys(texts: tuple[str, ...]) -> dict[str, Ed25519PublicKey]:
    """Trusted public keys by their base64 text, parsed once."""
    keys = (public_key(text) for text in texts if text.strip())
    return {public_text(key): key for key in keys}


def sign(key: Ed25519PrivateKey, message: bytes) -> str:
    """The base64 ed25519 signature of a canonical index."""
    return base64.b64encode(key.sign(CONTEXT + message)).decode()


def verifies(key: Ed25519PublicKey, message: bytes, signature: str) -> bool:
    """True when signature (base64) is key's signature of the canonical index."""
    try:
        key.verify(base64.b64decode(signature, validate=True), CONTEXT + message)
    except (InvalidSignature, ValueError, binascii.Error):
        return False
    return True


def keygen(private_file: Path) -> str:
    """Make a key pair: the private key to private_file (PEM, mode 600, never overwritten);
    returns the public key's base64."""
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    # Created with its final mode (no readable window); O_EXCL: an existing key is never lost.
    try:
        fd = os.open(private_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise BadInput(f"{private_file}: exists; not overwriting a key") from None
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
        f.flush()
        os.fsync(f.fileno())
    return public_text(key.public_key())
