"""The registry as the engine's cache backend for images: a key's output exists when its tag
does, and publishing pushes the image, its attestation, then the key tag."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipelines.core.progress import say
from pipelines.stages.images.attestations import attach, attestation_tag
from pipelines.stages.images.oci import load_image_index
from pipelines.stages.images.registry import Registry
from pipelines.stages.images.registry_push import push_image


@dataclass(frozen=True)
class RegistryCache:
    """The engine's cache backend for images: output for a key exists when its tag does.

    publish pushes the built image's blobs, then its manifest under extra tags, and the key
    tag last: the key tag appears only once everything it names is in the registry.
    """

    registry: Registry
    repository: str
    # Tags pushed beside the key tag, asked for only when publishing (`git rev-parse` is not
    # free, and a no-op run publishes nothing).
    extra_tags: Callable[[], tuple[str, ...]] = tuple
    name: str = "registry"
    # The signed envelope of an image pushed (ref by digest, key, step record), or None: no
    # attestation (a base image, or no signing key in this run).
    attest: Callable[[str, str, dict[str, Any]], bytes] | None = None
    # Another repository of the registry whose blobs a push mounts instead of sending them (the
    # base's, asked for only when publishing), or None.
    mount_from: Callable[[], str | None] = lambda: None

    @staticmethod
    def key_tag(key: str) -> str:
        """The tag that marks the image of a key (the image cache)."""
        return f"key-{key[:32]}"

    def has(self, key: str) -> bool:
        """True when the registry holds the key's tag (and, for an attested image, its
        attestation: an image pushed before it was signed is built and attested again)."""
        digest = self.registry.manifest_digest(self.repository, self.key_tag(key))
        if digest is None or self.attest is None:
            return digest is not None
        return self.registry.manifest_digest(self.repository, attestation_tag(digest)) is not None

    def publish(self, key: str, work: Path, record: dict[str, Any]) -> None:
        """Push the image the step wrote (work/out/image.json), then its attestation when it
        is signed, the key tag last."""
        image = load_image_index(work / "out")
        digest = push_image(
            self.registry, self.repository, image, list(self.extra_tags()), self.mount_from()
        )
        where = f"{self.registry.host}/{self.repository}@{digest}"
        if self.attest is not None:
            envelope = self.attest(where, key, record)
            attach(self.registry, self.repository, digest, envelope, work)
            say(record["name"], f"attested {digest[:19]} (in-toto SLSA v1, DSSE)")
        self.registry.push_manifest(self.repository, self.key_tag(key), image.manifest)
        say(record["name"], where)
