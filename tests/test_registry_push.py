"""Pushes that survive a cut: a blob goes up in chunks, and a connection cut mid-chunk goes on
where the registry says the upload stands; the local stack's registry (CNCF distribution) gives
a session up once a chunk arrived in part, so the push starts a new one and says what it sent
again."""

from __future__ import annotations

import hashlib
import os

from support.cutting_proxy import CuttingProxy

from pipelines.images.registry import Registry
from pipelines.progress import NoProgress

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
    # Distribution refuses the old session (its size is no longer the offset it signed): the
    # first chunk and the cut one go again, no more.
    assert line == f"push: {digest[7:19]}: 20.0 MiB, cut 1 time(s), 8.0 MiB sent again"
    # The registry holds exactly the blob's bytes.
    direct = Registry(stack.registry)
    r = direct._call("GET", f"{direct.base}/{repo}/blobs/{digest}")
    assert r.status == 200 and hashlib.sha256(r.data).hexdigest() == digest[7:]
