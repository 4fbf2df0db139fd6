"""An OCI distribution registry, spoken to directly: blobs and manifests by digest, then tags."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import requests

from pipelines.images.oci import MANIFEST_TYPE, Image
from pipelines.images.spec import ImageError

ACCEPT = ", ".join(
    [
        MANIFEST_TYPE,
        "application/vnd.oci.image.index.v1+json",
        "application/vnd.docker.distribution.manifest.v2+json",
    ]
)


@dataclass(frozen=True)
class Registry:
    """A registry at host:port (plain HTTP on loopback, HTTPS elsewhere)."""

    host: str

    @property
    def base(self) -> str:
        """The URL prefix of the API."""
        local = self.host.startswith(("127.", "localhost"))
        return f"{'http' if local else 'https'}://{self.host}/v2"

    def _call(self, method: str, url: str, **kwargs) -> requests.Response:
        try:
            return requests.request(method, url, timeout=kwargs.pop("timeout", 300), **kwargs)
        except requests.ConnectionError:
            raise ImageError(f"registry {self.host} unreachable ({method} {url})") from None

    def manifest_digest(self, repo: str, ref: str) -> str | None:
        """The digest a tag (or digest) points to, or None when the registry lacks it."""
        r = self._call("HEAD", f"{self.base}/{repo}/manifests/{ref}", headers={"Accept": ACCEPT})
        if r.status_code == 404:
            return None
        self._check(r, f"HEAD manifest {repo}:{ref}")
        return r.headers.get("Docker-Content-Digest")

    def has_blob(self, repo: str, digest: str) -> bool:
        """True when the registry holds the blob."""
        r = self._call("HEAD", f"{self.base}/{repo}/blobs/{digest}")
        return r.status_code == 200

    def push_blob(self, repo: str, digest: str, path) -> bool:
        """Upload one blob unless present (monolithic upload); True when it was sent."""
        if self.has_blob(repo, digest):
            return False
        r = self._call("POST", f"{self.base}/{repo}/blobs/uploads/")
        self._check(r, f"start upload to {repo}")
        location = r.headers["Location"]
        if location.startswith("/"):
            location = self.base.removesuffix("/v2") + location
        separator = "&" if "?" in location else "?"
        with open(path, "rb") as body:
            r = self._call(
                "PUT",
                f"{location}{separator}digest={digest}",
                data=body,
                headers={"Content-Type": "application/octet-stream"},
            )
        self._check(r, f"upload {digest} to {repo}")
        return True

    def push_manifest(self, repo: str, ref: str, manifest: bytes) -> str:
        """Put a manifest under a tag (or its digest); returns its digest."""
        r = self._call(
            "PUT",
            f"{self.base}/{repo}/manifests/{ref}",
            data=manifest,
            headers={"Content-Type": MANIFEST_TYPE},
        )
        self._check(r, f"put manifest {repo}:{ref}")
        digest = "sha256:" + hashlib.sha256(manifest).hexdigest()
        if r.headers.get("Docker-Content-Digest", digest) != digest:
            raise ImageError(f"registry {self.host} stored {repo}:{ref} under another digest")
        return digest

    def push_image(self, repo: str, image: Image, tags: list[str]) -> str:
        """Push blobs, then the manifest by digest, then each tag; returns the digest."""
        for blob in image.blobs():
            self.push_blob(repo, blob.digest, blob.path)
        self.push_manifest(repo, image.digest, image.manifest)
        for tag in tags:
            self.push_manifest(repo, tag, image.manifest)
        return image.digest

    def _check(self, r: requests.Response, what: str) -> None:
        if r.status_code >= 400:
            raise ImageError(f"registry {self.host}: {what}: HTTP {r.status_code} {r.text[:200]}")
