"""Deterministic OCI images: normalized layer tars, a gzip we write ourselves, fixed configs.

Every field that could vary between two builds of the same inputs is pinned here, by name:
entry order (sorted), mtimes (clamped to SOURCE_DATE_EPOCH), owners (0/0, no names), PAX
records only for extended attributes (in sorted order) and what a plain header cannot hold (long
names, big sizes; never atime/ctime or float times), the gzip header (no name, mtime 0, OS 255)
and deflate settings, and the config's timestamps and builder-specific fields.
"""

from __future__ import annotations

import datetime
import gzip
import hashlib
import json
import os
import tarfile
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Literal, Protocol, cast

from pipelines.core.files import fsync_fd
from pipelines.core.progress import human_bytes, say
from pipelines.engine.keys import canonical_json
from pipelines.stages.images.layer_format import GZIP_LEVEL

# One entry of a layer tar: its header, and its data (None: no data, a folder or a link).
TarEntry = tuple[tarfile.TarInfo, IO[bytes] | None]

MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"
CONFIG_TYPE = "application/vnd.oci.image.config.v1+json"
LAYER_TYPE = "application/vnd.oci.image.layer.v1.tar+gzip"
# Extended attributes as builders write them into layer tars (Docker: SCHILY.xattr.*, libarchive:
# LIBARCHIVE.xattr.*): a file capability set with setcap lives there and must survive.
XATTR_RECORDS = ("SCHILY.xattr.", "LIBARCHIVE.xattr.")
# Config fields kept from the builder: what the image runs with. Everything else (container
# ids, hostnames, builder versions, timestamps) differs between two builds of the same inputs.
RUN_CONFIG_FIELDS = (
    "Env",
    "Cmd",
    "Entrypoint",
    "WorkingDir",
    "User",
    "ExposedPorts",
    "Volumes",
    "Labels",
    "StopSignal",
)


@dataclass(frozen=True)
class Blob:
    """A content-addressed file of the image: its digest, size and where its bytes are."""

    digest: str
    size: int
    path: Path
    media_type: str


@dataclass(frozen=True)
class Image:
    """A normalized image: manifest bytes and digest, config and layer blobs."""

    manifest: bytes
    config: Blob
    layers: tuple[Blob, ...]

    @property
    def digest(self) -> str:
        """The manifest digest: the image's identity in a registry."""
        return "sha256:" + hashlib.sha256(self.manifest).hexdigest()

    def blobs(self) -> tuple[Blob, ...]:
        """Config and layers, the blobs a registry needs before the manifest."""
        return (self.config, *self.layers)


def normal_info(info: tarfile.TarInfo, epoch: int) -> tarfile.TarInfo:
    """A copy of a tar header with every varying field pinned."""
    out = tarfile.TarInfo(info.name)
    out.type = info.type
    out.mode = info.mode
    out.size = info.size if info.isreg() else 0
    out.linkname = info.linkname
    out.devmajor, out.devminor = info.devmajor, info.devminor
    out.mtime = min(int(info.mtime), epoch)
    out.uid = out.gid = 0
    out.uname = out.gname = ""
    out.pax_headers = {
        name: info.pax_headers[name]
        for name in sorted(info.pax_headers)
        if name.startswith(XATTR_RECORDS)
    }
    return out


def sorted_members(tar: tarfile.TarFile, epoch: int) -> Iterator[TarEntry]:
    """The members of a layer tar sorted by name, headers normalized.

    A hard link must follow its target; after sorting, the first name of a link group
    carries the data and the other names link to it.
    """
    members = {m.name: m for m in tar.getmembers() if m.name not in (".", "./")}
    holder_of = {}  # every name of a link group -> the name holding the data in the source
    for m in members.values():
        if m.islnk():
            holder_of[m.name] = holder_of[m.linkname] = m.linkname
    first_of: dict[str, str] = {}
    for name, holder in holder_of.items():
        first_of[holder] = min(first_of.get(holder, name), name)
    for name in sorted(members):
        member = members[name]
        if name in holder_of:
            source = members[holder_of[name]]
            first = first_of[source.name]
            info = normal_info(source, epoch)
            info.name = name
            if name == first:
                yield info, tar.extractfile(source)
            else:
                info.type, info.linkname, info.size = tarfile.LNKTYPE, first, 0
                yield info, None
        else:
            yield normal_info(member, epoch), tar.extractfile(member) if member.isreg() else None


class ByteSink(Protocol):
    """Where a HashingSink passes bytes on: a file, or a gzip stream."""

    def write(self, data: bytes, /) -> int:
        """Take data."""

    def close(self) -> None:
        """No more data."""


class HashingSink:
    """A write-only file object that hashes and counts the bytes it passes on to dest."""

    def __init__(self, dest: ByteSink):
        self.dest = dest
        self.sha = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        """Pass data on, hashing it."""
        self.sha.update(data)
        self.size += len(data)
        return self.dest.write(data)

    def flush(self) -> None:
        """gzip flushes its file object; dest is flushed by its owner."""


class LayerWriter:
    """A file object for tarfile that gzips as it is written, hashing the plain tar (the
    diff_id) and the compressed bytes (the blob digest) in the same pass."""

    def __init__(self, dest: IO[bytes]):
        self.packed = HashingSink(dest)
        self.plain = HashingSink(
            gzip.GzipFile(
                filename="", mode="wb", compresslevel=GZIP_LEVEL, fileobj=self.packed, mtime=0
            )
        )

    def write(self, data: bytes) -> int:
        """Take plain tar bytes."""
        return self.plain.write(data)

    def tell(self) -> int:
        """Plain bytes written so far (tarfile asks)."""
        return self.plain.size

    def finish(self) -> tuple[str, str, int]:
        """Close the gzip stream: (blob digest, diff_id, compressed size)."""
        self.plain.dest.close()
        return (
            "sha256:" + self.packed.sha.hexdigest(),
            "sha256:" + self.plain.sha.hexdigest(),
            self.packed.size,
        )


def write_layer(members: Iterable[TarEntry], out_dir: Path) -> tuple[Blob, str]:
    """A gzipped layer blob from (header, data) pairs, in one pass; (blob, diff_id)."""
    tmp = out_dir / f"layer.{os.getpid()}.{threading.get_ident()}.tmp"
    with open(tmp, "wb") as dest:
        writer = LayerWriter(dest)
        # tarfile writes through write() and asks tell(), which LayerWriter gives.
        fileobj = cast(IO[bytes], writer)
        # PAX: the only tar format with room for extended attributes.
        with tarfile.open(fileobj=fileobj, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for info, data in members:
                tar.addfile(info, data)
        digest, diff_id, size = writer.finish()
        dest.flush()
        fsync_fd(dest.fileno())
    final = out_dir / digest.split(":")[1]
    tmp.rename(final)
    return Blob(digest, size, final, LAYER_TYPE), diff_id


class Discard:
    """A byte sink that keeps nothing (a HashingSink in front of it only hashes)."""

    def write(self, data: bytes, /) -> int:
        """Take data and drop it."""
        return len(data)

    def close(self) -> None:
        """Nothing to close."""


def normal_diff_id(layer_tar: Path, epoch: int) -> str:
    """The diff_id a layer tar will have once normalized, without compressing it: builders
    (vfs's `docker save` among them) give one layer different tar bytes from one save to the
    next, but its normalized tar is one."""
    sink = HashingSink(Discard())
    with tarfile.open(layer_tar, "r:*") as tar:
        # tarfile writes through write() and asks tell(): the sink counts what it passed on.
        fileobj = cast(IO[bytes], PlainCounter(sink))
        with tarfile.open(fileobj=fileobj, mode="w", format=tarfile.PAX_FORMAT) as out:
            for info, data in sorted_members(tar, epoch):
                out.addfile(info, data)
    return "sha256:" + sink.sha.hexdigest()


class PlainCounter:
    """A file object for tarfile over a HashingSink: write() passes on, tell() counts."""

    def __init__(self, sink: HashingSink):
        self.sink = sink

    def write(self, data: bytes) -> int:
        """Take plain tar bytes."""
        return self.sink.write(data)

    def tell(self) -> int:
        """Plain bytes written so far (tarfile asks)."""
        return self.sink.size


def normalize_layer(layer_tar: Path, epoch: int, out_dir: Path) -> tuple[Blob, str]:
    """A normalized, gzipped layer blob and its diff_id (sha256 of the plain tar)."""
    with tarfile.open(layer_tar, "r:*") as tar:
        return write_layer(sorted_members(tar, epoch), out_dir)


def normal_config(
    builder_config: dict[str, Any], diff_ids: list[str], epoch: int
) -> dict[str, Any]:
    """The image config with only what the image runs with, and fixed timestamps."""
    created = epoch_iso(epoch)
    run = builder_config.get("config") or {}
    history = [
        {"created": created, "created_by": h.get("created_by", ""), **_empty(h)}
        for h in builder_config.get("history", [])
    ]
    return {
        "architecture": builder_config["architecture"],
        "os": builder_config.get("os", "linux"),
        **({"variant": builder_config["variant"]} if builder_config.get("variant") else {}),
        "created": created,
        "config": {k: run[k] for k in RUN_CONFIG_FIELDS if run.get(k)},
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
        "history": history,
    }


def _empty(history_entry: dict[str, Any]) -> dict[str, Any]:
    return {"empty_layer": True} if history_entry.get("empty_layer") else {}


def epoch_iso(epoch: int) -> str:
    """SOURCE_DATE_EPOCH as the RFC 3339 time OCI configs use."""
    return datetime.datetime.fromtimestamp(epoch, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def write_blob(out_dir: Path, data: bytes, media_type: str) -> Blob:
    """A small blob (config) written by its digest."""
    digest = hashlib.sha256(data).hexdigest()
    path = out_dir / digest
    path.write_bytes(data)
    return Blob("sha256:" + digest, len(data), path, media_type)


def assemble(config: dict[str, Any], layers: list[Blob], out_dir: Path) -> Image:
    """The manifest of config and layers, as canonical JSON."""
    config_blob = write_blob(out_dir, canonical_json(config), CONFIG_TYPE)
    manifest = {
        "schemaVersion": 2,
        "mediaType": MANIFEST_TYPE,
        "config": descriptor(config_blob),
        "layers": [descriptor(layer) for layer in layers],
    }
    return Image(canonical_json(manifest), config_blob, tuple(layers))


def save_image_index(image: Image, folder: Path) -> None:
    """Write what a push needs (manifest, blob digests and paths) as folder/image.json."""
    blobs = [
        {"digest": b.digest, "size": b.size, "path": str(b.path), "media_type": b.media_type}
        for b in image.blobs()
    ]
    index = {"manifest": image.manifest.decode(), "blobs": blobs}
    (folder / "image.json").write_text(json.dumps(index, indent=2))


def load_image_index(folder: Path) -> Image:
    """The image an image.json describes (its blobs where the index says)."""
    index = json.loads((folder / "image.json").read_text())
    blobs = [Blob(b["digest"], b["size"], Path(b["path"]), b["media_type"]) for b in index["blobs"]]
    return Image(index["manifest"].encode(), blobs[0], tuple(blobs[1:]))


def descriptor(blob: Blob) -> dict[str, Any]:
    """The OCI descriptor of a blob."""
    return {"mediaType": blob.media_type, "digest": blob.digest, "size": blob.size}


class Layers(Protocol):
    """Where normalized layers are kept between builds (pipelines.stages.images.layer_cache)."""

    def normalize(self, layer_tar: Path, epoch: int) -> tuple[Blob, str, str]:
        """(blob, diff_id, how it was had: found, restored or normalized)."""


def extract_tar(
    tar: tarfile.TarFile, dest: Path, tar_filter: Literal["data", "fully_trusted"]
) -> None:
    """Extract a tar with the named filter (PEP 706: "data", "fully_trusted") where Python has
    filters (3.11.4 on); Debian bookworm's python3 is 3.11.2, which has none and extracts as
    before filters. Both tars extracted here are this pipeline's own: a context it wrote, an
    image its engine saved."""
    if hasattr(tarfile, "data_filter"):
        tar.extractall(dest, filter=tar_filter)
    else:
        tar.extractall(dest)


def normalize_saved_image(
    saved: Path, epoch: int, out_dir: Path, layers_cache: Layers | None = None
) -> Image:
    """Normalize a `docker save` tar of one image (its manifest.json) into out_dir."""
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        unpacked = Path(tmp)
        with tarfile.open(saved) as tar:
            extract_tar(tar, unpacked, "fully_trusted")
        config, layer_paths = read_saved_image(unpacked)
        layers, diff_ids = [], []
        for n, path in enumerate(layer_paths, 1):
            # A GB10 layer is gigabytes: each gets its line, with its size and how long it took.
            size, started = path.stat().st_size, time.monotonic()
            if layers_cache:
                blob, diff_id, how = layers_cache.normalize(path, epoch)
            else:
                (blob, diff_id), how = normalize_layer(path, epoch, out_dir), "normalized"
            took = time.monotonic() - started
            say(
                "image",
                f"layer {n}/{len(layer_paths)} {how}: {human_bytes(size)} in {took:.1f} s,"
                f" {blob.digest[7:19]}",
            )
            layers.append(blob)
            diff_ids.append(diff_id)
        return assemble(normal_config(config, diff_ids, epoch), layers, out_dir)


def read_saved_image(unpacked: Path) -> tuple[dict[str, Any], list[Path]]:
    """The builder's config and the layer tar paths of an unpacked `docker save`."""
    manifest = json.loads((unpacked / "manifest.json").read_text())
    if len(manifest) != 1:
        raise ValueError(f"expected one image in the saved tar, found {len(manifest)}")
    entry = manifest[0]
    config = json.loads((unpacked / entry["Config"]).read_text())
    return config, [unpacked / layer for layer in entry["Layers"]]
