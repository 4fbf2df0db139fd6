"""Which key signs this run's attestations and which keys its deploys trust, from the settings;
a local-stack profile's own key made once under the git-ignored store."""

from __future__ import annotations

from pathlib import Path

from pipelines.core.settings import Settings
from pipelines.core.signing.namedkeys import (
    KeyKind,
    PublicKey,
    SigningKey,
    generate,
    public_key,
    signing_key,
)

SIGNING_ENV = "SPARKFORGE_SIGNING_KEY"
SIGNING_FILE_ENV = "SPARKFORGE_SIGNING_KEY_FILE"
TRUSTED_ENV = "SPARKFORGE_TRUSTED_KEYS"
LOCAL_KEY_NAME = "local-stack"
ATTESTATION_KEYS = KeyKind(
    parse_secret=signing_key,
    parse_public=public_key,
    generate=generate,
    signing_env=SIGNING_ENV,
    file_env=SIGNING_FILE_ENV,
    trusted_env=TRUSTED_ENV,
    local_name=LOCAL_KEY_NAME,
    local_label="the local stack's key",
)


def local_key(keys: Path) -> SigningKey:
    """The local-stack key in the folder keys (the store's, git-ignored), made on first use."""
    return ATTESTATION_KEYS.local(keys)


def attestation_signer(settings: Settings, local_keys: Path | None) -> SigningKey | None:
    """The key that signs attestations: SPARKFORGE_SIGNING_KEY, else the file
    SPARKFORGE_SIGNING_KEY_FILE names, else (a local-stack profile, local_keys its store's key
    folder) the store's own; else none."""
    return ATTESTATION_KEYS.signer(settings.signing_key, settings.signing_key_file, local_keys)


def deploy_trusted(settings: Settings, local_keys: Path | None) -> dict[str, PublicKey]:
    """The keys whose attestations a deploy accepts: SPARKFORGE_TRUSTED_KEYS, and for a
    local-stack profile (local_keys given) the key this machine signs with."""
    own = attestation_signer(settings, local_keys) if local_keys else None
    return ATTESTATION_KEYS.trusted(settings.trusted_keys, own)
