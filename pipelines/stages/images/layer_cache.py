"""Normalized layers as keyed outputs: in the store, and in the remote cache between runners.

A builder's layer tar is normalized (sorted, clamped, gzipped) once per key: the diff_id of its
normalized tar and what compresses it (`layer_format`). CI's runners start with an empty store,
so the remote cache carries the normalized layers from one run to the next; what comes back from
it (a bucket others can write) is checked against its own digests before it joins an image.
"""

from __future__ import annotations

import hashlib
import json
import re
import zlib
from pathlib import Path
from typing import Any

from pipelines.core.errors import PipelineError
from pipelines.core.progress import say
from pipelines.engine.keys import key_material, step_key
from pipelines.engine.steps import RemoteCache
from pipelines.engine.store import Store, read_record
from pipelines.stages.images.layer_format import layer_format
from pipelines.stages.images.oci import LAYER_TYPE, Blob, normal_diff_id, normalize_layer

RECIPE, VERSION = "layer", 1
INDEX = "layer.json"
DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
CHUNK = 1 << 20


class BadLayer(PipelineError):
    """A cached layer whose index or bytes do not hold what they claim."""


def layer_key(diff_id: str) -> str:
    """The key of a layer's gzipped form: its normalized tar (diff_id) and the compressor."""
    params = {"format": layer_format()}
    return step_key(key_material(RECIPE, VERSION, params, {"layer.tar": diff_id}, {}))


def read_index(out: Path) -> tuple[str, str, int]:
    """(digest, diff_id, size) from an output folder's layer.json, each field checked."""
    try:
        index = json.loads((out / INDEX).read_text())
        digest, diff_id, size = index["digest"], index["diff_id"], index["size"]
    except (OSError, ValueError, TypeError, KeyError):
        raise BadLayer(f"{INDEX}: unreadable or lacking digest, diff_id or size") from None
    for field, value in (("digest", digest), ("diff_id", diff_id)):
        if not isinstance(value, str) or not DIGEST.fullmatch(value):
            raise BadLayer(f"{INDEX}: field {field}: expected sha256:<64 hex>")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise BadLayer(f"{INDEX}: field size: expected a byte count")
    return digest, diff_id, size


def check_layer(out: Path) -> tuple[Blob, str]:
    """The blob and diff_id of a restored layer, its gzip bytes and plain tar both re-hashed."""
    digest, diff_id, size = read_index(out)
    path = out / digest.split(":")[1]
    packed, plain, seen = hashlib.sha256(), hashlib.sha256(), 0
    try:
        with open(path, "rb") as f:
            unzip = zlib.decompressobj(wbits=31)  # gzip framing
            while chunk := f.read(CHUNK):
                seen += len(chunk)
                packed.update(chunk)
                plain.update(unzip.decompress(chunk))
            plain.update(unzip.flush())
            whole = unzip.eof and not unzip.unused_data
    except OSError:
        raise BadLayer(f"blob {digest[:19]} missing from the entry") from None
    except zlib.error:
        raise BadLayer(f"blob {digest[:19]}: not a gzip stream") from None
    if seen != size or "sha256:" + packed.hexdigest() != digest:
        raise BadLayer(f"blob {digest[:19]}: its bytes are not the digest and size its index says")
    if not whole or "sha256:" + plain.hexdigest() != diff_id:
        raise BadLayer(f"blob {digest[:19]}: its tar is not the diff_id its index says")
    return Blob(digest, size, path, LAYER_TYPE), diff_id


class LayerCache:
    """Normalized layers by key, in the store and (when configured) the remote cache."""

    def __init__(self, store: Store, remote: RemoteCache | None = None):
        self.store = store
        self.remote = remote

    def normalize(self, layer_tar: Path, epoch: int) -> tuple[Blob, str, str]:
        """(blob, diff_id, how): how is found (this store), restored (the remote cache) or
        normalized (here, and shared through the remote cache when it is writable)."""
        diff_id = normal_diff_id(layer_tar, epoch)
        key = layer_key(diff_id)
        if self.store.has(key):
            return (*self._stored(key), "found")
        if self._restore(key, diff_id):
            return (*self._stored(key), "restored")

        def normalize_into(out: Path) -> None:
            blob, made = normalize_layer(layer_tar, epoch, out)
            index = {"digest": blob.digest, "diff_id": made, "size": blob.size}
            (out / INDEX).write_text(json.dumps(index, sort_keys=True))

        record = {"name": RECIPE, "recipe": RECIPE, "version": VERSION}
        _, built = self.store.build(key, record, normalize_into)
        if built:
            self._share(key)
        return (*self._stored(key), "normalized" if built else "found")

    def _stored(self, key: str) -> tuple[Blob, str]:
        """The blob and diff_id of a layer this store holds (its own output: size checked)."""
        out = self.store.output_dir(key)
        digest, diff_id, size = read_index(out)
        path = out / digest.split(":")[1]
        if not path.is_file() or path.stat().st_size != size:
            raise BadLayer(f"store layer {key[:16]}: blob {digest[:19]} missing or resized")
        return Blob(digest, size, path, LAYER_TYPE), diff_id

    def _restore(self, key: str, diff_id: str) -> bool:
        """Restore key's layer (of that diff_id) from the remote cache, its bytes checked;
        False to normalize it here."""
        remote = self.remote
        if remote is None:
            return False

        def fill(out: Path) -> dict[str, Any] | None:
            record = remote.restore(key, out)
            if record is not None and check_layer(out)[1] != diff_id:
                raise BadLayer(f"its entry is for another layer than {diff_id[:19]}")
            return record

        try:
            return self.store.restore(key, fill)
        except PipelineError as err:
            say("image", f"{remote.name}: refused layer {key[:16]}: {err}; normalizing it here")
            return False

    def _share(self, key: str) -> None:
        """Upload a layer normalized here; a failure is one line, the layer stands here."""
        remote = self.remote
        if remote is None or not remote.writable:
            return
        folder = self.store.step_dir(key)
        try:
            remote.publish(key, folder, read_record(folder / "step.json"))
        except PipelineError as err:
            say("image", f"layer {key[:16]} not uploaded to {remote.name}: {err}")
