"""Pushes that survive a cut: a blob goes up in chunks, and a connection cut mid-chunk goes on
where the registry says the upload stands; the local stack's registry (CNCF distribution) gives
a session up once a chunk arrived in part, so the push starts a new one and says what it sent
again. A blob another repository of the registry holds (an image's base layer) is mounted from
it, not sent again."""

from __future__ import annotations

import contextlib
import hashlib
import http.server
import os
import uuid

import pytest
import requests
from support import http_double
from support.cutting_proxy import CuttingProxy

from pipelines.core.progress import NoProgress
from pipelines.stages.images.promote import move_stable
from pipelines.stages.images.registry import Registry
from pipelines.stages.images.registry_push import push_blob
from pipelines.stages.images.spec import ImageError

MiB = 1 << 20


def test_a_push_cut_mid_blob_completes_and_says_what_it_sent_again(stack, tmp_path, capsys):
    registry_port = int(stack.registry.rsplit(":", 1)[1])
    # The first connection (the pool keeps it for every request) is cut 6 MiB into what it
    # sends: in the middle of the second 4 MiB chunk.
    proxy = CuttingProxy(registry_port, every=1, limit=6 * MiB, request=True, times=1)
    blob = tmp_path / "layer"
    data = os.urandom(20 * MiB)
    blob.write_bytes(data)
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    repo = f"sparkforge-test/push-{digest[7:19]}"
    try:
        through = Registry(f"127.0.0.1:{proxy.port}", chunk=4 * MiB)
        assert push_blob(through, repo, digest, blob, NoProgress())
    finally:
        proxy.close()
    assert proxy.cuts == 1
    said = capsys.readouterr().out
    (line,) = [line for line in said.splitlines() if line.startswith("push: ")]
    # Distribution drops the cut session (its size is no longer the offset it signed): the
    # first chunk and the cut one go again, no more. When its answer to "where does the upload
    # stand" comes before it has failed the cut chunk, the resumed chunk is refused instead (CI
    # saw it): that chunk goes again as well.
    assert line in {
        f"push: {digest[7:19]}: 20.0 MiB, cut 1 time(s), started again from byte 0 1 time(s),"
        f" {again} MiB sent again"
        for again in ("8.0", "12.0")
    }
    # The registry holds exactly the blob's bytes.
    direct = Registry(stack.registry)
    r = direct._call("GET", f"{direct.base}/{repo}/blobs/{digest}")
    assert r.status == 200 and hashlib.sha256(r.data).hexdigest() == digest[7:]


class DroppingRegistry(Registry):
    """A client that cancels its own upload session (DELETE, as the API allows) just before
    its second chunk: the real registry then no longer knows the session it PATCHes."""

    def __init__(self, address: str, chunk: int):
        super().__init__(address, chunk=chunk)
        self.patches = 0

    def _call(self, method, url, body=None, **kwargs):
        if method == "PATCH":
            self.patches += 1
            if self.patches == 2:
                assert super()._call("DELETE", url).status == 204
        return super()._call(method, url, body, **kwargs)


def test_a_session_the_registry_dropped_mid_push_starts_again_from_byte_zero(
    stack, tmp_path, capsys
):
    blob = tmp_path / "layer"
    data = os.urandom(10 * MiB)
    blob.write_bytes(data)
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    repo = f"sparkforge-test/push-{digest[7:19]}"
    dropping = DroppingRegistry(stack.registry, chunk=4 * MiB)
    assert push_blob(dropping, repo, digest, blob, NoProgress())
    said = capsys.readouterr().out
    (line,) = [line for line in said.splitlines() if line.startswith("push: ")]
    assert line == (
        f"push: {digest[7:19]}: 10.0 MiB, cut 0 time(s), started again from byte 0 1 time(s),"
        " 8.0 MiB sent again"
    )
    direct = Registry(stack.registry)
    r = direct._call("GET", f"{direct.base}/{repo}/blobs/{digest}")
    assert r.status == 200 and hashlib.sha256(r.data).hexdigest() == digest[7:]


def upload(registry: str, repo: str, data: bytes) -> str:
    """data as a blob of repo, put by the API's monolithic upload (requests, not the code under
    test); its digest."""
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    started = requests.post(f"http://{registry}/v2/{repo}/blobs/uploads/", timeout=30)
    assert started.status_code == 202, started.text
    location = started.headers["Location"]
    url = location if location.startswith("http") else f"http://{registry}{location}"
    put = requests.put(url, params={"digest": digest}, data=data, timeout=30)
    assert put.status_code == 201, put.text
    return digest


def blob_of(registry: str, repo: str, digest: str) -> bytes | None:
    """The blob's bytes as the registry serves them in repo, or None where it has none."""
    got = requests.get(f"http://{registry}/v2/{repo}/blobs/{digest}", timeout=30)
    return got.content if got.status_code == 200 else None


def test_a_blob_another_repository_holds_is_mounted_from_it_not_sent(stack, tmp_path, capsys):
    data = os.urandom(MiB)
    run = uuid.uuid4().hex[:12]
    source, target = f"sparkforge-test/base-{run}", f"sparkforge-test/image-{run}"
    digest = upload(stack.registry, source, data)
    # Other bytes at the path: had the push sent them, the registry would refuse the digest.
    other = tmp_path / "layer"
    other.write_bytes(bytes(MiB))
    assert not push_blob(
        Registry(stack.registry), target, digest, other, NoProgress(), mount_from=source
    )
    assert blob_of(stack.registry, target, digest) == data
    said = capsys.readouterr().out.splitlines()
    assert f"push: {digest[7:19]}: 1.0 MiB mounted from {source}" in said


def test_a_blob_the_mount_source_lacks_is_sent_in_the_session_the_registry_opened(
    stack, tmp_path, capsys
):
    data = os.urandom(MiB)
    blob = tmp_path / "layer"
    blob.write_bytes(data)
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    run = uuid.uuid4().hex[:12]
    source, target = f"sparkforge-test/base-{run}", f"sparkforge-test/image-{run}"
    upload(stack.registry, source, b"another blob")  # the source exists, without this blob
    assert push_blob(
        Registry(stack.registry), target, digest, blob, NoProgress(), mount_from=source
    )
    assert blob_of(stack.registry, target, digest) == data
    assert blob_of(stack.registry, source, digest) is None
    assert "mounted" not in capsys.readouterr().out


class NoSessionHandler(http.server.BaseHTTPRequestHandler):
    """A registry that lacks every blob and answers an upload's start (a mount's too) with
    `status` and no Location: no session to send the blob to."""

    status = 202

    def do_HEAD(self) -> None:
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self) -> None:
        self.send_response(self.status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


# An upload's start answered without a session: a 201 or a 202 with no Location; a mount
# answered 202 (not mounted) with no Location. (A mount answered 201 is a mount made.)
NO_SESSION = [(201, None), (202, None), (202, "sparkforge/base-bookworm")]


@pytest.mark.parametrize(("status", "mount_from"), NO_SESSION)
def test_an_upload_started_without_a_session_is_one_line(tmp_path, status, mount_from):
    handler = type("Handler", (NoSessionHandler,), {"status": status})
    blob = tmp_path / "layer"
    blob.write_bytes(b"layer bytes")
    digest = "sha256:" + hashlib.sha256(b"layer bytes").hexdigest()
    with http_double.serving(handler) as url:
        host = url.removeprefix("http://")
        with pytest.raises(ImageError) as err:
            push_blob(Registry(host), "sparkforge/tiny", digest, blob, NoProgress(), mount_from)
    assert str(err.value) == (
        f"registry {host}: start upload to sparkforge/tiny: expected 202 with a Location, got"
        f" HTTP {status}"
    )


class HostileManifests(http.server.BaseHTTPRequestHandler):
    """A registry that lacks `stable`, answers a manifest GET with `body` (endless when None),
    takes every PUT, and lists tags on a page whose next page is itself."""

    body: bytes | None = b'{"schemaVersion":2,"note":"another image"}'
    puts: list[str] = []

    def do_HEAD(self) -> None:
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self) -> None:
        if "/tags/list" in self.path:
            page = b'{"tags":["a"]}'
            self.send_response(200)
            self.send_header("Link", f'<{self.path}>; rel="next"')
            self.send_header("Content-Length", str(len(page)))
            self.end_headers()
            self.wfile.write(page)
            return
        self.send_response(200)
        self.send_header("Content-Type", "application/vnd.oci.image.manifest.v1+json")
        if self.body is not None:
            self.send_header("Content-Length", str(len(self.body)))
            self.end_headers()
            self.wfile.write(self.body)
            return
        self.end_headers()
        with contextlib.suppress(OSError):  # the client hangs up once it has read enough
            while True:
                self.wfile.write(b" " * MiB)

    def do_PUT(self) -> None:
        self.puts.append(self.path)
        self.send_response(201)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


DIGEST = "sha256:" + "1" * 64


def test_a_manifest_whose_bytes_are_not_its_digest_moves_no_stable():
    # Promotion reads the manifest by digest and pushes it again as `stable`: other bytes
    # would point `stable` at another image than the digest it names.
    handler = type("Handler", (HostileManifests,), {"puts": []})
    with http_double.serving(handler) as url:
        host = url.removeprefix("http://")
        with pytest.raises(ImageError) as err:
            move_stable(Registry(host), "sparkforge/runtime", DIGEST)
    assert str(err.value) == (
        f"registry {host}: manifest sparkforge/runtime {DIGEST}: the registry sent other bytes"
        " than the digest names"
    )
    assert handler.puts == []


@pytest.mark.timeout(60)
def test_an_endless_manifest_is_refused_at_its_cap():
    handler = type("Handler", (HostileManifests,), {"body": None})
    with http_double.serving(handler) as url:
        host = url.removeprefix("http://")
        with pytest.raises(ImageError) as err:
            Registry(host).manifest("sparkforge/runtime", "latest")
    assert str(err.value) == (
        f"registry {host}: manifest sparkforge/runtime latest: over {4 << 20} bytes"
    )


@pytest.mark.timeout(60)
def test_a_tag_list_whose_next_page_is_itself_is_one_line():
    with http_double.serving(HostileManifests) as url:
        host = url.removeprefix("http://")
        with pytest.raises(ImageError) as err:
            Registry(host).tags("sparkforge/runtime")
    assert str(err.value) == (
        f"registry {host}: tags of sparkforge/runtime: a page links back:"
        f" http://{host}/v2/sparkforge/runtime/tags/list?n=1000"
    )
