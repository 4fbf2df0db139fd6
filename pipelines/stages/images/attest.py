"""Each pushed image's provenance: a signed in-toto Statement (SLSA v1) of what built it, from
what, when and where, signed with the attestation key (core/signing/)."""

from __future__ import annotations

import socket
from collections.abc import Callable
from datetime import UTC, datetime
from functools import cached_property
from typing import TYPE_CHECKING, Any

from pipelines.engine.stage import Context

if TYPE_CHECKING:
    from pipelines.core.signing.namedkeys import SigningKey
    from pipelines.engine.store import Store


def utc_now() -> str:
    """Now, as RFC 3339 in UTC (SLSA's timestamps)."""
    return datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


class Attester:
    """Signs the attestation of each image a run pushes (when it has an attestation key)."""

    def __init__(self, context: Context, store: Store):
        self.profile, self.settings = context.profile, context.settings
        self.who, self.git, self.store = context.who, context.git, store
        self.built_at: tuple[str, str] | None = None  # the last build's start and end (UTC)

    @cached_property
    def signer(self) -> SigningKey | None:
        """The key this run signs attestations with (read when first needed, never printed)."""
        from pipelines.core.signing.keyring import attestation_signer

        local = self.store.area("keys") if self.profile.local_stack else None
        return attestation_signer(self.settings, local)

    def attest(self) -> Callable[[str, str, dict[str, Any]], bytes] | None:
        """What signs an image's attestation when it is pushed; None without a signing key."""
        configured = self.settings.signing_key or self.settings.signing_key_file
        return self.attestation if configured or self.profile.local_stack else None

    def attestation(self, ref: str, key: str, record: dict[str, Any]) -> bytes:
        """The signed in-toto Statement (SLSA v1 provenance) of the image ref just pushed."""
        from pipelines.core.signing.envelope import sign_statement
        from pipelines.core.signing.statement import ImageBuild, image_statement

        signer = self.signer
        assert signer is not None  # attest gives no attester without a key
        now = utc_now()
        started, finished = self.built_at or (now, now)
        name, _, digest = ref.partition("@")
        fields = ("recipe", "version", "params", "inputs", "deps")
        build = ImageBuild(
            name=name,
            digest=digest,
            key=key,
            material={field: record.get(field) for field in fields},
            builder=f"{self.who} on {socket.gethostname()}",
            repository=self.settings.source_repository,
            commit=self.git(),
            started=started,
            finished=finished,
        )
        return sign_statement(image_statement(build), signer)
