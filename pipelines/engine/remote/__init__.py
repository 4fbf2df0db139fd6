"""The remote cache of step outputs (S3, signed entries): the engine's third cache backend."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipelines.core.errors import BadInput

# The cache's modules (S3, signatures) are imported when one is configured: dodo.py asks for
# one at every start, `doit list` included.
if TYPE_CHECKING:
    from pipelines.engine.remote.remote import RemoteCache

__all__ = ["remote_cache"]


def remote_cache(
    url: str | None, signing: str | None, trusted: tuple[str, ...], readonly: bool
) -> RemoteCache | None:
    """The remote cache the settings ask for, or None; a writer also trusts its own key."""
    if not url:
        return None
    from pipelines.engine.remote.remote import RemoteCache
    from pipelines.engine.remote.signing import TRUSTED_ENV, cache_signing_key, cache_trusted_keys

    signer = cache_signing_key(signing) if signing else None
    keys = cache_trusted_keys(trusted)
    if signer is not None:
        keys.setdefault(signer.name, signer.public)
    if not keys:
        raise BadInput(
            f"environment SPARKFORGE_REMOTE_CACHE={url!r}: no key is trusted; set {TRUSTED_ENV}"
            " (comma-separated name:base64 ed25519 public keys)"
        )
    return RemoteCache(url, keys, signer, readonly or signer is None)
