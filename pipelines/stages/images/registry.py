"""An OCI distribution registry, spoken to directly: blobs and manifests by digest, then tags."""

from __future__ import annotations

import functools
import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any
from urllib.parse import urlencode, urlsplit

from pipelines.core.addresses import is_loopback
from pipelines.core.progress import ProgressSink, human_bytes, say
from pipelines.stages.images.oci import MANIFEST_TYPE
from pipelines.stages.images.registry_login import login
from pipelines.stages.images.spec import ImageBadInput, ImageError, ImageUnreachable

if TYPE_CHECKING:
    import urllib3

# Uploads: a blob goes in chunks of this size, each resumable where the registry says it stands;
# a GB10 layer is gigabytes, and one cut connection must not start it again from zero.
UPLOAD_CHUNK = 32 << 20
UPLOAD_RESUMES = 5  # cut connections one blob survives
# An upload session the registry no longer knows (404 BLOB_UPLOAD_UNKNOWN/INVALID) or whose
# size is not the offset sent (416).
GIVEN_UP = (404, 416)
OCTETS = "application/octet-stream"
INDEX_TYPE = "application/vnd.oci.image.index.v1+json"
# The most of a manifest read (distribution's own limit on what it accepts): an image's is
# kilobytes, and a hostile registry's endless answer must not fill memory.
MAX_MANIFEST = 4 << 20
ACCEPT = ", ".join(
    [
        MANIFEST_TYPE,
        INDEX_TYPE,
        "application/vnd.docker.distribution.manifest.v2+json",
    ]
)


@dataclass(frozen=True)
class Registry:
    """A registry at host:port (plain HTTP on a literal loopback address, HTTPS elsewhere),
    logged in on demand; its credentials go to its own host or a token realm it names over
    HTTPS, nowhere else."""

    # host:port, or where to read it on the first call (the local stack's, once it runs)
    address: str | Callable[[], str]
    chunk: int = UPLOAD_CHUNK  # bytes per PATCH of an upload
    # Authorization headers by challenge scope, learned from 401 answers (never printed).
    _tokens: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @functools.cached_property
    def host(self) -> str:
        """Where the registry answers, as host:port (checked: nothing else fits in a URL)."""
        host = self.address if isinstance(self.address, str) else self.address()
        if not re.fullmatch(HOST_PORT, host):
            raise ImageBadInput(
                f"registry {host!r}: expected host[:port] (a name, an IPv4 address or an"
                " [IPv6] address, then an optional port)"
            )
        return host

    @property
    def base(self) -> str:
        """The URL prefix of the API: plain HTTP only where the traffic never leaves the host."""
        scheme = "http" if is_loopback(urlsplit(f"//{self.host}").hostname) else "https"
        return f"{scheme}://{self.host}/v2"

    def is_own(self, url: str) -> bool:
        """Whether url is on the registry itself (scheme, host and port): where its
        credentials may go (an upload location can name any host)."""
        return origin(url) == origin(self.base)

    def _call(
        self, method: str, url: str, body: Path | bytes | None = None, **kwargs: Any
    ) -> urllib3.BaseHTTPResponse:
        """One request; on a 401 it logs in as the challenge asks and tries once more."""
        import urllib3  # loaded on the first registry call, not for a run that makes none

        headers = kwargs.pop("headers", {})
        for attempt in range(2):
            auth = self._tokens.get(self._scope_of(url), {}) if self.is_own(url) else {}
            try:
                if isinstance(body, Path):
                    with open(body, "rb") as data:
                        size = {"Content-Length": str(body.stat().st_size)}
                        r = self._send(method, url, data, {**headers, **auth, **size}, **kwargs)
                else:
                    r = self._send(method, url, body, {**headers, **auth}, **kwargs)
            except urllib3.exceptions.HTTPError as err:
                reason = type(err).__name__
                raise ImageUnreachable(
                    f"registry {self.host} unreachable ({method} {url}: {reason})"
                ) from None
            if r.status != 401 or attempt or not self.is_own(url):
                return r
            challenge = r.headers.get("WWW-Authenticate", "")
            self._tokens[self._scope_of(url)] = login(self.host, challenge)
        return r

    @staticmethod
    def _send(
        method: str,
        url: str,
        data: IO[bytes] | bytes | None,
        headers: dict[str, str],
        **kwargs: Any,
    ) -> urllib3.BaseHTTPResponse:
        """One HTTP exchange on the process's shared connection pool (kept alive between calls)."""
        from pipelines.core.httpjson import http_pool  # urllib3 with the first call, not at import

        return http_pool().request(method, url, body=data, headers=headers, **kwargs)

    def _scope_of(self, url: str) -> str:
        """The repository a URL is about (tokens are per repository)."""
        path = url.removeprefix(self.base + "/")
        for marker in ("/manifests/", "/blobs/"):
            if marker in path:
                return path.split(marker)[0]
        return path

    def manifest_digest(self, repo: str, ref: str) -> str | None:
        """The digest a tag (or digest) points to, or None when the registry lacks it."""
        r = self._call("HEAD", f"{self.base}/{repo}/manifests/{ref}", headers={"Accept": ACCEPT})
        if r.status == 404:
            return None
        self._check(r, f"HEAD manifest {repo}:{ref}")
        return r.headers.get("Docker-Content-Digest")

    def manifest(self, repo: str, ref: str) -> tuple[bytes, str] | None:
        """(exact bytes, media type) of a manifest, or None when the registry lacks it; the
        bytes as `checked_manifest` takes them (what is read here is pushed again, as `stable`)."""
        url, accept = f"{self.base}/{repo}/manifests/{ref}", {"Accept": ACCEPT}
        r = self._call("GET", url, headers=accept, preload_content=False)
        try:
            if r.status == 404:
                return None
            data = r.read(MAX_MANIFEST + 1)
        finally:
            r.release_conn()
        where = f"registry {self.host}: manifest {repo} {ref}"
        return checked_manifest(where, ref, r.status, data), r.headers.get(
            "Content-Type", MANIFEST_TYPE
        )

    def small_blob(self, repo: str, digest: str, limit: int) -> bytes:
        """A small blob's bytes (an attestation), checked against its digest; refused when the
        registry lacks it, sends more than limit bytes or other bytes than the digest names."""
        r = self._call("GET", f"{self.base}/{repo}/blobs/{digest}", preload_content=False)
        try:
            self._check(r, f"GET blob {repo}@{digest}")
            data = r.read(limit + 1)
        finally:
            r.release_conn()
        if len(data) > limit:
            raise ImageError(f"registry {self.host}: blob {repo}@{digest} is over {limit} bytes")
        if "sha256:" + hashlib.sha256(data).hexdigest() != digest:
            raise ImageError(f"registry {self.host}: blob {repo}@{digest} has other bytes")
        return data

    def referrers(self, repo: str, digest: str, artifact_type: str) -> list[Any] | None:
        """The manifests an OCI 1.1 registry lists as referring to digest (of artifact_type),
        or None when it has no referrers API (distribution 2.x answers 404)."""
        url = f"{self.base}/{repo}/referrers/{digest}?artifactType={artifact_type}"
        r = self._call("GET", url, headers={"Accept": INDEX_TYPE})
        if r.status == 404:
            return None
        self._check(r, f"GET referrers of {repo}@{digest}")
        try:
            manifests = json.loads(r.data)["manifests"]
        except (ValueError, TypeError, KeyError, RecursionError):
            manifests = None
        if not isinstance(manifests, list):
            raise ImageError(f"registry {self.host}: referrers of {repo}@{digest}: not an index")
        return manifests

    def tags(self, repo: str) -> list[str]:
        """Every tag of a repository (the API's pages followed by their Link), [] when it has
        none or does not exist."""
        found: list[str] = []
        url: str | None = f"{self.base}/{repo}/tags/list?n=1000"
        seen: set[str] = set()
        while url:
            if url in seen:
                raise ImageError(f"registry {self.host}: tags of {repo}: a page links back: {url}")
            seen.add(url)
            r = self._call("GET", url)
            if r.status == 404:
                return found
            self._check(r, f"list tags of {repo}")
            try:
                page = r.json().get("tags") or []
            except (ValueError, AttributeError):
                raise ImageError(f"registry {self.host}: tags of {repo}: not a tag list") from None
            if not isinstance(page, list) or not all(isinstance(t, str) for t in page):
                raise ImageError(f"registry {self.host}: tags of {repo}: not a tag list")
            found += page
            link = re.match(r"<([^>]+)>", r.headers.get("Link", ""))
            url = self._absolute(link.group(1)) if link else None
            if url is not None and not self.is_own(url):
                raise ImageError(f"registry {self.host}: tags of {repo}: next page elsewhere")
        return found

    def delete_manifest(self, repo: str, digest: str) -> None:
        """Delete a manifest by digest (every tag on it goes too); gone already is fine."""
        r = self._call("DELETE", f"{self.base}/{repo}/manifests/{digest}")
        if r.status == 405:
            raise ImageError(
                f"registry {self.host}: deletes are off (its config: storage.delete.enabled)"
            )
        if r.status != 404:
            self._check(r, f"delete {repo}@{digest}")

    def has_blob(self, repo: str, digest: str) -> bool:
        """True when the registry holds the blob."""
        r = self._call("HEAD", f"{self.base}/{repo}/blobs/{digest}")
        return r.status == 200

    def upload_session(
        self, repo: str, digest: str, path: Path, mount_from: str | None
    ) -> str | None:
        """Where the blob at path is to be uploaded: None when repo holds it already, or holds
        it now, mounted from the repository mount_from of this registry (no byte sent); else
        the location of the upload session the registry opened."""
        if self.has_blob(repo, digest):
            return None
        if mount_from is None:
            return self._start_upload(repo)
        return self._mount(repo, digest, mount_from, path)

    def upload(
        self, repo: str, digest: str, path: Path, progress: ProgressSink, location: str
    ) -> None:
        """Send a blob to its upload session at location, in chunks (the API's PATCH with
        Content-Range). After a cut, the upload goes on from where the registry says it stands;
        a registry that gave the session up (distribution does, once a chunk arrived in part),
        then or later, gets a new session from byte 0."""
        size, offset, sent, resumes = path.stat().st_size, 0, 0, 0
        cuts = restarts = 0  # connections cut; new sessions from byte 0 (the old one lost)
        with open(path, "rb") as data:
            while offset < size:
                data.seek(offset)
                chunk = data.read(min(self.chunk, size - offset))
                end = offset + len(chunk) - 1
                headers = {"Content-Type": OCTETS, "Content-Range": f"{offset}-{end}"}
                try:
                    r = self._call("PATCH", location, body=chunk, headers=headers)
                except ImageUnreachable:
                    resumes += 1
                    cuts += 1
                    if resumes > UPLOAD_RESUMES:
                        raise
                    sent += len(chunk)
                    location, offset = self._resume(repo, location)
                    restarts += offset == 0
                    continue
                if r.status in GIVEN_UP and offset and resumes < UPLOAD_RESUMES:
                    # The session ended under us: after a cut, the registry can answer where
                    # it stands before it has failed the cut chunk and dropped the session.
                    resumes += 1
                    restarts += 1
                    sent += len(chunk)
                    location, offset = self._start_upload(repo), 0
                    continue
                self._check(r, f"upload {digest} to {repo} at {offset}")
                location = self._absolute(r.headers.get("Location", location))
                sent += len(chunk)
                progress.advance(digest, len(chunk))
                offset = end + 1
        r = self._call(
            "PUT", f"{location}{'&' if '?' in location else '?'}digest={digest}", body=b""
        )
        self._check(r, f"upload {digest} to {repo}")
        if cuts or restarts:
            say(
                "push",
                f"{digest[7:19]}: {human_bytes(size)}, cut {cuts} time(s), started again from"
                f" byte 0 {restarts} time(s), {human_bytes(sent - size)} sent again",
            )

    def _start_upload(self, repo: str) -> str:
        """A new upload session's location."""
        r = self._call("POST", f"{self.base}/{repo}/blobs/uploads/")
        self._check(r, f"start upload to {repo}")
        return self._opened(r, repo)

    def _mount(self, repo: str, digest: str, source: str, path: Path) -> str | None:
        """Mount the blob into repo from source, another repository of this registry (the
        base's layers: no byte sent again). None when mounted; else the upload session the
        registry opened instead (it lacks the blob there, or will not mount it)."""
        query = urlencode({"mount": digest, "from": source})
        r = self._call("POST", f"{self.base}/{repo}/blobs/uploads/?{query}")
        if r.status == 201:
            say("push", f"{digest[7:19]}: {human_bytes(path.stat().st_size)} mounted from {source}")
            return None
        self._check(r, f"mount {digest} from {source} into {repo}")
        return self._opened(r, repo)

    def _opened(self, r: urllib3.BaseHTTPResponse, repo: str) -> str:
        """The upload session an answer opened (its Location), refused in one line without one."""
        location = r.headers.get("Location")
        if r.status != 202 or not location:
            raise ImageError(
                f"registry {self.host}: start upload to {repo}: expected 202 with a Location,"
                f" got HTTP {r.status}"
            )
        return self._absolute(location)

    def _absolute(self, location: str) -> str:
        """An upload location as a URL (the registry may answer with a path alone)."""
        return self.base.removesuffix("/v2") + location if location.startswith("/") else location

    def _resume(self, repo: str, location: str) -> tuple[str, int]:
        """Where an interrupted upload goes on: the session's fresh location and the byte after
        the Range the registry holds; else a new session from byte 0 (the registry no longer
        knows the old one, or says "0-0", which cannot tell no byte from one)."""
        r = self._call("GET", location)
        held = r.headers.get("Range", "")  # "0-N": bytes 0..N are in
        if r.status == 204 and re.fullmatch(r"0-[0-9]+", held) and held != "0-0":
            return self._absolute(r.headers.get("Location", location)), int(held[2:]) + 1
        return self._start_upload(repo), 0

    def push_manifest(
        self, repo: str, ref: str, manifest: bytes, media_type: str = MANIFEST_TYPE
    ) -> str:
        """Put a manifest under a tag (or its digest); returns its digest."""
        url = f"{self.base}/{repo}/manifests/{ref}"
        r = self._call("PUT", url, body=manifest, headers={"Content-Type": media_type})
        self._check(r, f"put manifest {repo}:{ref}")
        digest = "sha256:" + hashlib.sha256(manifest).hexdigest()
        if r.headers.get("Docker-Content-Digest", digest) != digest:
            raise ImageError(f"registry {self.host} stored {repo}:{ref} under another digest")
        return digest

    def _check(self, r: urllib3.BaseHTTPResponse, what: str) -> None:
        """Refuse an error answer, with the start of what the registry said."""
        if r.status >= 400:
            said = r.data[:200].decode(errors="replace")
            raise ImageError(f"registry {self.host}: {what}: HTTP {r.status} {said}")


# host[:port]: a DNS name or IPv4 address, or an [IPv6] address; no user, path or query.
HOST_PORT = r"(?:[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?|\[[0-9A-Fa-f:.]+\])(?::[0-9]{1,5})?"


def checked_manifest(where: str, ref: str, status: int, data: bytes) -> bytes:
    """A manifest answer's bytes (at most MAX_MANIFEST + 1 of them read), refused in one line
    when it is no 200, is past MAX_MANIFEST, or is asked for by digest and has other bytes."""
    if status != 200:
        raise ImageError(f"{where}: HTTP {status} {data[:200].decode(errors='replace')}")
    if len(data) > MAX_MANIFEST:
        raise ImageError(f"{where}: over {MAX_MANIFEST} bytes")
    if ref.startswith("sha256:") and "sha256:" + hashlib.sha256(data).hexdigest() != ref:
        raise ImageError(f"{where}: the registry sent other bytes than the digest names")
    return data


def origin(url: str) -> tuple[str, str | None, int | None]:
    """(scheme, host, port) of a URL, the port made explicit; one that does not parse has none."""
    try:
        parts = urlsplit(url)
        port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
    except ValueError:
        return ("", None, None)
    return (parts.scheme, parts.hostname, port)
