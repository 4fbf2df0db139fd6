"""The remote cache's keys (named, `name:base64`: core/signing/namedkeys.py) and the signatures
of its entry indexes."""

from __future__ import annotations

import base64
import binascii

from pipelines.core.signing.namedkeys import PublicKey, SigningKey, signing_key, trusted_keys

# Domain separation: an index signature can never be taken for a signature of anything else.
CONTEXT = b"sparkforge-remote-cache-index-v1\0"
SIGNING_ENV = "SPARKFORGE_CACHE_SIGNING_KEY"
TRUSTED_ENV = "SPARKFORGE_CACHE_TRUSTED_KEYS"


def cache_signing_key(text: str) -> SigningKey:
    """The secret key from SPARKFORGE_CACHE_SIGNING_KEY (`name:base64`); never quoted."""
    return signing_key(text, f"environment {SIGNING_ENV}")


def cache_trusted_keys(texts: tuple[str, ...]) -> dict[str, PublicKey]:
    """The keys of SPARKFORGE_CACHE_TRUSTED_KEYS by name."""
    return trusted_keys(texts, f"environment {TRUSTED_ENV}")


def sign(key: SigningKey, message: bytes) -> str:
    """The base64 ed25519 signature of a canonical index."""
    return base64.b64encode(key.key.sign(CONTEXT + message)).decode()


def verifies(key: PublicKey, message: bytes, signature: str) -> bool:
    """True when signature (base64) is key's signature of the canonical index."""
    try:
        raw = base64.b64decode(signature, validate=True)
    except (ValueError, binascii.Error):
        return False
    return key.verifies(CONTEXT + message, raw)
