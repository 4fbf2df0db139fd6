"""Which key signs this run's attestations and which keys its deploys trust, from the settings;
a local-stack profile's own key made once under the git-ignored store."""

from __future__ import annotations

from pathlib import Path

from pipelines.files import create_once
from pipelines.namedkeys import (
    PublicKey,
    SigningKey,
    generate,
    read_secret_file,
    signing_key,
    trusted_keys,
)
from pipelines.settings import Settings

SIGNING_ENV = "SPARKFORGE_SIGNING_KEY"
SIGNING_FILE_ENV = "SPARKFORGE_SIGNING_KEY_FILE"
TRUSTED_ENV = "SPARKFORGE_TRUSTED_KEYS"
LOCAL_KEY_NAME = "local-stack"


def local_key(keys: Path) -> SigningKey:
    """The local-stack key in the folder keys (the store's, git-ignored), made on first use
    (mode 600; two makers at once end with one key: the second link fails, it reads the
    first's)."""
    path = keys / f"{LOCAL_KEY_NAME}.key"
    if not path.exists():
        create_once(path, (generate(LOCAL_KEY_NAME).text + "\n").encode())
    return read_secret_file(path, "the local stack's key")


def attestation_signer(settings: Settings, local_keys: Path | None) -> SigningKey | None:
    """The key that signs attestations: SPARKFORGE_SIGNING_KEY, else the file
    SPARKFORGE_SIGNING_KEY_FILE names, else (a local-stack profile, local_keys its store's key
    folder) the store's own; else none."""
    if settings.signing_key:
        return signing_key(settings.signing_key, f"environment {SIGNING_ENV}")
    if settings.signing_key_file:
        return read_secret_file(settings.signing_key_file, f"environment {SIGNING_FILE_ENV}")
    return local_key(local_keys) if local_keys else None


def deploy_trusted(settings: Settings, local_keys: Path | None) -> dict[str, PublicKey]:
    """The keys whose attestations a deploy accepts: SPARKFORGE_TRUSTED_KEYS, and for a
    local-stack profile (local_keys given) the key this machine signs with."""
    keys = trusted_keys(settings.trusted_keys, f"environment {TRUSTED_ENV}")
    if local_keys:
        own = attestation_signer(settings, local_keys)
        if own is not None and own.name not in keys:
            keys[own.name] = own.public
    return keys
