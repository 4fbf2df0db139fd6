"""Pushes made of the registry's calls: a blob the repository lacks, sent or mounted from another
repository of the registry; an image's blobs several at once with progress, then its manifest
by digest, then its tags."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pipelines.core.progress import Progress, ProgressSink
from pipelines.stages.images.oci import Blob, Image
from pipelines.stages.images.registry import Registry

PUSHERS = 4  # blobs uploaded at once
PROGRESS_BLOB = 64 << 20  # blobs this big get their own progress line


def push_blob(
    registry: Registry,
    repo: str,
    digest: str,
    path: Path,
    progress: ProgressSink,
    mount_from: str | None = None,
) -> bool:
    """Upload one blob unless repo holds it or it was mounted from mount_from; True when sent."""
    location = registry.upload_session(repo, digest, path, mount_from)
    if location is None:
        return False
    registry.upload(repo, digest, path, progress, location)
    return True


def push_image(
    registry: Registry, repo: str, image: Image, tags: list[str], mount_from: str | None = None
) -> str:
    """Push the blobs repo lacks (several at once, with progress of those sent; those the
    repository mount_from of the registry holds mounted from it), then the manifest by digest,
    then each tag; returns the digest."""
    blobs = image.blobs()

    def session(blob: Blob) -> str | None:
        return registry.upload_session(repo, blob.digest, blob.path, mount_from)

    with ThreadPoolExecutor(PUSHERS) as pool:
        sessions = list(pool.map(session, blobs))
    sends = [(b, at) for b, at in zip(blobs, sessions, strict=True) if at is not None]
    big = {b.digest: b.size for b, _ in sends if b.size >= PROGRESS_BLOB}
    progress = Progress(f"push {repo}", sum(b.size for b, _ in sends), big)

    def send(blob_at: tuple[Blob, str]) -> None:
        blob, location = blob_at
        registry.upload(repo, blob.digest, blob.path, progress, location)

    try:
        with ThreadPoolExecutor(PUSHERS) as pool:
            list(pool.map(send, sends))
    finally:
        progress.close()
    registry.push_manifest(repo, image.digest, image.manifest)
    for tag in tags:
        registry.push_manifest(repo, tag, image.manifest)
    return image.digest
