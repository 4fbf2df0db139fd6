"""Pushes that survive a cut: a blob goes up in chunks, and a connection cut mid-chunk goes on
where the registry says the upload stands; the local stack's registry (CNCF distribution) gives
a session up once a chunk arrived in part, so the push starts a new one and says what it sent
again."""

from __future__ import annotations

import hashlib
import os

from support.cutting_proxy import CuttingProxy

from pipelines.core.progress import NoProgress
from pipelines.stages.images.registry import Registry

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
        assert through.push_blob(repo, digest, blob, NoProgress())
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
    assert DroppingRegistry(stack.registry, chunk=4 * MiB).push_blob(
        repo, digest, blob, NoProgress()
    )
    said = capsys.readouterr().out
    (line,) = [line for line in said.splitlines() if line.startswith("push: ")]
    assert line == (
        f"push: {digest[7:19]}: 10.0 MiB, cut 0 time(s), started again from byte 0 1 time(s),"
        " 8.0 MiB sent again"
    )
    direct = Registry(stack.registry)
    r = direct._call("GET", f"{direct.base}/{repo}/blobs/{digest}")
    assert r.status == 200 and hashlib.sha256(r.data).hexdigest() == digest[7:]
