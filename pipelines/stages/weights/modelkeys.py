"""Named P-256 keys (`name:base64`) for the model's signature: the OpenSSF model signing library
signs with EC P-256/384/521 keys only, not the ed25519 keys of pipelines/core/signing/namedkeys.py.

A secret key is `name:` and the base64 of the 32-byte private scalar; a public key is `name:`
and the base64 of its 33-byte compressed point. Several are trusted at once, by name, as the
image keys are: rotate by trusting the new key before signing with it, revoke by unlisting.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from pipelines.core.errors import BadInput, run_main
from pipelines.core.progress import show
from pipelines.core.signing.namedkeys import (
    NAME,
    KeyKind,
    split_named,
    trusted_by_name,
    write_secret,
)

if TYPE_CHECKING:
    from pipelines.core.settings import Settings

SECRET_FORM = "name:base64 of a P-256 private scalar (32 bytes)"
PUBLIC_FORM = "name:base64 of a P-256 public key (33 bytes, compressed point)"
LOCAL_MODEL_KEY = "local-stack-model"
CURVE = ec.SECP256R1()
SIGNING_ENV = "SPARKFORGE_MODEL_SIGNING_KEY"
FILE_ENV = "SPARKFORGE_MODEL_SIGNING_KEY_FILE"
TRUSTED_ENV = "SPARKFORGE_MODEL_TRUSTED_KEYS"


@dataclass(frozen=True)
class ModelPublicKey:
    """A key trusted to sign models, and its name."""

    name: str
    key: ec.EllipticCurvePublicKey = field(compare=False)

    @property
    def pem(self) -> bytes:
        """The key as PEM (SubjectPublicKeyInfo), the form the library reads."""
        return self.key.public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )

    @property
    def hint(self) -> str:
        """What a signature names its key by: sha256 of the PEM, as the library records it."""
        return hashlib.sha256(self.pem).hexdigest()

    @property
    def text(self) -> str:
        """The key as it is trusted: `name:base64`."""
        point = self.key.public_bytes(
            serialization.Encoding.X962, serialization.PublicFormat.CompressedPoint
        )
        return f"{self.name}:{base64.b64encode(point).decode()}"


@dataclass(frozen=True)
class ModelSigningKey:
    """A secret model key and its name; never printed (repr hides it)."""

    name: str
    key: ec.EllipticCurvePrivateKey = field(repr=False, compare=False)

    @property
    def public(self) -> ModelPublicKey:
        """The public half, under the same name."""
        return ModelPublicKey(self.name, self.key.public_key())

    @property
    def pem(self) -> bytes:
        """The secret as unencrypted PKCS#8 PEM, for the library's signer (never stored)."""
        return self.key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )

    @property
    def text(self) -> str:
        """The secret as it is stored: `name:base64` of the scalar (a secret: never print it)."""
        scalar = self.key.private_numbers().private_value.to_bytes(32, "big")
        return f"{self.name}:{base64.b64encode(scalar).decode()}"


def model_signing_key(text: str, where: str) -> ModelSigningKey:
    """The secret model key in text (`name:base64`); errors never quote it."""
    parts = split_named(text)
    if parts is None or len(parts[1]) != 32:
        raise BadInput(f"{where}: expected {SECRET_FORM}")
    try:
        key = ec.derive_private_key(int.from_bytes(parts[1], "big"), CURVE)
    except ValueError:
        raise BadInput(f"{where}: expected {SECRET_FORM} (out of the curve's range)") from None
    return ModelSigningKey(parts[0], key)


def model_public_key(text: str, where: str) -> ModelPublicKey:
    """A trusted model key (`name:base64`); the text is public, so the error quotes it."""
    parts = split_named(text)
    if parts is None or len(parts[1]) != 33:
        raise BadInput(f"{where}: {text.strip()[:120]!r} is not {PUBLIC_FORM}")
    try:
        key = ec.EllipticCurvePublicKey.from_encoded_point(CURVE, parts[1])
    except ValueError:
        raise BadInput(f"{where}: {text.strip()[:120]!r}: not a point of P-256") from None
    return ModelPublicKey(parts[0], key)


def trusted_model_keys(texts: Iterable[str], where: str) -> dict[str, ModelPublicKey]:
    """Trusted model keys by name; one name for two different keys is refused."""
    return trusted_by_name(texts, where, model_public_key)


def generate_model_key(name: str) -> ModelSigningKey:
    """A new secret model key named name."""
    if not re.fullmatch(NAME, name):
        raise BadInput(f"key name {name!r}: expected {NAME} (letters, digits, '.', '_', '-')")
    return ModelSigningKey(name, ec.generate_private_key(CURVE))


MODEL_KEYS = KeyKind(
    parse_secret=model_signing_key,
    parse_public=model_public_key,
    generate=generate_model_key,
    signing_env=SIGNING_ENV,
    file_env=FILE_ENV,
    trusted_env=TRUSTED_ENV,
    local_name=LOCAL_MODEL_KEY,
    local_label="the local stack's model key",
)


def local_model_key(keys: Path) -> ModelSigningKey:
    """The local stack's model key in the folder keys (the store's, git-ignored), made once."""
    return MODEL_KEYS.local(keys)


def model_signer(settings: Settings, local_keys: Path | None) -> ModelSigningKey | None:
    """The key that signs the model: SPARKFORGE_MODEL_SIGNING_KEY, else the file
    SPARKFORGE_MODEL_SIGNING_KEY_FILE names, else (a local-stack profile, local_keys its store's
    key folder) the store's own; else none."""
    return MODEL_KEYS.signer(
        settings.model_signing_key, settings.model_signing_key_file, local_keys
    )


def model_trusted(settings: Settings, local_keys: Path | None) -> dict[str, ModelPublicKey]:
    """The keys whose model signatures are accepted: SPARKFORGE_MODEL_TRUSTED_KEYS, and for a
    local-stack profile the key this machine signs with."""
    own = model_signer(settings, local_keys) if local_keys else None
    return MODEL_KEYS.trusted(settings.model_trusted_keys, own)


def main(argv: list[str] | None = None) -> int:
    """`python -m pipelines.stages.weights.modelkeys keygen NAME FILE`: a named model key pair."""
    parser = argparse.ArgumentParser(prog="python -m pipelines.stages.weights.modelkeys")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("keygen", help="make a named P-256 model key pair (name:base64)")
    gen.add_argument("name", help="the key's name, e.g. lab-model-2026")
    gen.add_argument("file", type=Path, help="where the private key goes (must not exist)")
    args = parser.parse_args(argv)
    key = generate_model_key(args.name)
    write_secret(args.file, key)
    show(key.public.text)
    show(
        f"secret key: {args.file} (mode 600): its contents are a model signing key"
        f" ({SIGNING_ENV} or {FILE_ENV}); the line above goes into {TRUSTED_ENV}",
        stream=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    run_main(main)
