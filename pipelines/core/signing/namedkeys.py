"""Named ed25519 keys in Nix's form, `name:base64`: the one parser of every key that signs or is
trusted (the remote cache's, the image attestations').

A secret key is `name:` and the base64 of the 32-byte seed (or of seed and public key, 64 bytes,
as Nix's `nix key generate-secret` writes); a public key is `name:` and the base64 of its 32 raw
bytes. Several keys are trusted at once, by name, so a key is rotated by trusting the new one
before signing with it and revoked by no longer listing it.

A KeyKind is one kind of signing key (ed25519 for attestations, P-256 for the model, in
stages/weights/modelkeys.py): which key signs (the environment, the file it names, the local
stack's own) and which are trusted, chosen the same way for every kind.
"""

from __future__ import annotations

import base64
import binascii
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from pipelines.core.errors import BadInput
from pipelines.core.files import create_once, read_capped

# cryptography is imported where a key is parsed, made or used: listing tasks needs none.
if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import (
        Ed25519PrivateKey,
        Ed25519PublicKey,
    )

NAME = r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}"
KEY_FILE_MAX_BYTES = 64 << 10
SECRET_FORM = "name:base64 of an ed25519 seed (32 bytes) or seed and public key (64)"
PUBLIC_FORM = "name:base64 of an ed25519 public key (32 raw bytes)"
KeyT = TypeVar("KeyT", bound="Named")
PublicT = TypeVar("PublicT", bound="Named")
PublicT_co = TypeVar("PublicT_co", bound="Named", covariant=True)
SecretT = TypeVar("SecretT", bound="Secret[Named]")


@dataclass(frozen=True)
class PublicKey:
    """A trusted key and the name signatures carry."""

    name: str
    key: Ed25519PublicKey = field(compare=False)

    @property
    def text(self) -> str:
        """The key as it is trusted: `name:base64`."""
        from cryptography.hazmat.primitives import serialization

        raw = self.key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        return f"{self.name}:{base64.b64encode(raw).decode()}"

    def verifies(self, message: bytes, signature: bytes) -> bool:
        """True when signature is this key's of message."""
        from cryptography.exceptions import InvalidSignature

        try:
            self.key.verify(signature, message)
        except InvalidSignature:
            return False
        return True


@dataclass(frozen=True)
class SigningKey:
    """A secret key and its name; never printed (repr hides it)."""

    name: str
    key: Ed25519PrivateKey = field(repr=False, compare=False)

    @property
    def public(self) -> PublicKey:
        """The public half, under the same name."""
        return PublicKey(self.name, self.key.public_key())

    @property
    def text(self) -> str:
        """The secret as it is stored: `name:base64` of the seed (a secret: never print it)."""
        from cryptography.hazmat.primitives import serialization

        seed = self.key.private_bytes(
            serialization.Encoding.Raw,
            serialization.PrivateFormat.Raw,
            serialization.NoEncryption(),
        )
        return f"{self.name}:{base64.b64encode(seed).decode()}"


def split_named(text: str) -> tuple[str, bytes] | None:
    """(name, decoded bytes) of `name:base64`, or None when it is not that form."""
    name, colon, encoded = text.strip().partition(":")
    if not colon or not re.fullmatch(NAME, name):
        return None
    try:
        return name, base64.b64decode(encoded, validate=True)
    except (ValueError, binascii.Error):
        return None


def signing_key(text: str, where: str) -> SigningKey:
    """The secret key in text (`name:base64`); where names its source. Errors never quote it."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    parts = split_named(text)
    if parts is None or len(parts[1]) not in (32, 64):
        raise BadInput(f"{where}: expected {SECRET_FORM}")
    name, raw = parts
    key = Ed25519PrivateKey.from_private_bytes(raw[:32])
    if len(raw) == 64 and raw[32:] != key.public_key().public_bytes_raw():
        raise BadInput(
            f"{where}: expected {SECRET_FORM} (its last 32 are not the seed's public key)"
        )
    return SigningKey(name, key)


def public_key(text: str, where: str) -> PublicKey:
    """A trusted key (`name:base64`); the text is public, so the error quotes it."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    parts = split_named(text)
    if parts is None or len(parts[1]) != 32:
        raise BadInput(f"{where}: {text.strip()[:120]!r} is not {PUBLIC_FORM}")
    return PublicKey(parts[0], Ed25519PublicKey.from_public_bytes(parts[1]))


class Named(Protocol):
    """A public key of any type: its name and its `name:base64` text."""

    @property
    def name(self) -> str: ...

    @property
    def text(self) -> str: ...


def trusted_by_name(
    texts: Iterable[str], where: str, parse: Callable[[str, str], KeyT]
) -> dict[str, KeyT]:
    """Keys parsed by parse, by name; one name for two different keys is refused (which
    would it be?)."""
    keys: dict[str, KeyT] = {}
    for text in texts:
        if not text.strip():
            continue
        key = parse(text, where)
        if key.name in keys and keys[key.name].text != key.text:
            raise BadInput(f"{where}: key name {key.name!r} is given for two different keys")
        keys[key.name] = key
    return keys


def trusted_keys(texts: Iterable[str], where: str) -> dict[str, PublicKey]:
    """Trusted ed25519 keys by name."""
    return trusted_by_name(texts, where, public_key)


def generate(name: str) -> SigningKey:
    """A new secret key named name."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    if not re.fullmatch(NAME, name):
        raise BadInput(f"key name {name!r}: expected {NAME} (letters, digits, '.', '_', '-')")
    return SigningKey(name, Ed25519PrivateKey.generate())


def write_secret(path: Path, key: Named) -> None:
    """The secret key to path, mode 600 from the start; an existing file is never replaced."""
    # O_EXCL: an existing key is never lost; its final mode at creation: no readable window.
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise BadInput(f"{path}: exists; not overwriting a key") from None
    with os.fdopen(fd, "w") as f:
        f.write(key.text + "\n")
        f.flush()
        os.fsync(f.fileno())


def keygen(name: str, path: Path) -> str:
    """Make a key pair: the secret to path (mode 600, never overwritten); returns the public
    key's `name:base64`."""
    key = generate(name)
    write_secret(path, key)
    return key.public.text


class Secret(Protocol[PublicT_co]):
    """A secret key of any type: its name, its stored `name:base64` text and its public half."""

    @property
    def name(self) -> str: ...

    @property
    def text(self) -> str: ...

    @property
    def public(self) -> PublicT_co: ...


def read_key_file(path: Path, setting: str, parse: Callable[[str, str], KeyT]) -> KeyT:
    """The key in the file a setting names, parsed by parse; one line when it cannot be read
    (missing, not a regular file, over KEY_FILE_MAX_BYTES: a key is some 100 bytes)."""
    try:
        data = read_capped(path, KEY_FILE_MAX_BYTES, KeyFileError)
    except KeyFileError as err:
        reason = str(err).removeprefix(f"{path}: ")
        raise BadInput(f"{setting}={path}: cannot read the key file ({reason})") from None
    try:
        text = data.decode()
    except UnicodeDecodeError:
        raise BadInput(f"{setting}={path}: the key file is not text") from None
    return parse(text, f"{path} (named by {setting})")


class KeyFileError(BadInput):
    """A key file that cannot be read as one (exit 2)."""


@dataclass(frozen=True)
class KeyKind(Generic[SecretT, PublicT]):
    """One kind of signing key (the attestations', the model's): its parsers, its maker, the
    settings that name it, and the local stack's own key of that kind."""

    parse_secret: Callable[[str, str], SecretT]
    parse_public: Callable[[str, str], PublicT]
    generate: Callable[[str], SecretT]
    signing_env: str
    file_env: str
    trusted_env: str
    local_name: str
    local_label: str

    def local(self, keys: Path) -> SecretT:
        """The local stack's key in the folder keys (the store's, git-ignored), made on first use
        (mode 600; two makers at once end with one key: the second link fails, it reads the
        first's)."""
        path = keys / f"{self.local_name}.key"
        if not path.exists():
            create_once(path, (self.generate(self.local_name).text + "\n").encode())
        return read_key_file(path, self.local_label, self.parse_secret)

    def signer(
        self, text: str | None, path: Path | None, local_keys: Path | None
    ) -> SecretT | None:
        """The signing key: text (from signing_env), else the file path (from file_env) names,
        else (a local-stack profile, local_keys its store's key folder) the store's own; else
        none."""
        if text:
            return self.parse_secret(text, f"environment {self.signing_env}")
        if path:
            return read_key_file(path, f"environment {self.file_env}", self.parse_secret)
        return self.local(local_keys) if local_keys else None

    def trusted(self, texts: Iterable[str], own: Secret[PublicT] | None) -> dict[str, PublicT]:
        """The trusted keys texts (from trusted_env) by name, and own's public half (the key a
        local stack signs with) when its name is not among them."""
        keys = trusted_by_name(texts, f"environment {self.trusted_env}", self.parse_public)
        if own is not None and own.name not in keys:
            keys[own.name] = own.public
        return keys
