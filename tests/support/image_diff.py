"""What differs between two builds of one image, file and field: the config's fields, then
each layer's entries (present in one only; a header field; the content, with the first line that
differs and, for colon-separated records such as /etc/shadow, the field). Written for the
reproducibility tests' failure lines, as diffoscope would say it, without diffoscope's weight."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path
from typing import Any

HEADER_FIELDS = ("type", "mode", "uid", "gid", "uname", "gname", "mtime", "size", "linkname")
MAX_LINES = 20


def image_blobs(folder: Path) -> tuple[dict[str, Any], list[Path]]:
    """The config and the layer files of a build's image.json."""
    index = json.loads((folder / "image.json").read_text())
    blobs = [Path(b["path"]) for b in index["blobs"]]
    return json.loads(blobs[0].read_bytes()), blobs[1:]


def layer_entries(path: Path) -> dict[str, tuple[tarfile.TarInfo, bytes | None]]:
    """A layer's entries by name: header and content."""
    entries = {}
    with tarfile.open(path, "r:gz") as tar:
        for member in tar:
            data = tar.extractfile(member) if member.isreg() else None
            entries[member.name] = (member, data.read() if data else None)
    return entries


def content_difference(name: str, a: bytes, b: bytes) -> str:
    """Where two contents of one file first differ: line and field for text, offset else."""
    if b"\0" not in a + b:
        for number, (x, y) in enumerate(zip(a.splitlines(), b.splitlines(), strict=False), 1):
            if x == y:
                continue
            xs, ys = x.split(b":"), y.split(b":")
            if len(xs) == len(ys) > 1:
                field = next(i for i, (p, q) in enumerate(zip(xs, ys, strict=True), 1) if p != q)
                return (
                    f"{name}: line {number} ({xs[0].decode(errors='replace')}), field {field}:"
                    f" {xs[field - 1].decode(errors='replace')!r} !="
                    f" {ys[field - 1].decode(errors='replace')!r}"
                )
            return f"{name}: line {number}: {x[:120]!r} != {y[:120]!r}"
    offset = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    offset = min(len(a), len(b)) if offset is None else offset
    return f"{name}: content differs from byte {offset} ({len(a)} and {len(b)} bytes)"


def image_differences(first: Path, second: Path) -> list[str]:
    """Lines naming what differs between the builds in two folders (empty: nothing does)."""
    config_a, layers_a = image_blobs(first)
    config_b, layers_b = image_blobs(second)
    lines = [
        f"config: {key}: {config_a.get(key)!r} != {config_b.get(key)!r}"
        for key in sorted(set(config_a) | set(config_b))
        if key != "rootfs" and config_a.get(key) != config_b.get(key)
    ]
    if len(layers_a) != len(layers_b):
        return [*lines, f"layers: {len(layers_a)} != {len(layers_b)}"]
    for n, (path_a, path_b) in enumerate(zip(layers_a, layers_b, strict=True), 1):
        if path_a.name == path_b.name:  # one digest: the same layer
            continue
        a, b = layer_entries(path_a), layer_entries(path_b)
        for name in sorted(set(a) | set(b)):
            if name not in a or name not in b:
                lines.append(f"layer {n}: {name}: only in the {'first' if name in a else 'second'}")
                continue
            (info_a, data_a), (info_b, data_b) = a[name], b[name]
            for field in HEADER_FIELDS:
                if getattr(info_a, field) != getattr(info_b, field):
                    lines.append(
                        f"layer {n}: {name}: {field} {getattr(info_a, field)!r} !="
                        f" {getattr(info_b, field)!r}"
                    )
            if data_a != data_b and data_a is not None and data_b is not None:
                lines.append(f"layer {n}: " + content_difference(name, data_a, data_b))
        if not lines:
            lines.append(f"layer {n}: same entries, other bytes (the compressor or tar headers)")
    more = [f"... {len(lines) - MAX_LINES} more"] if len(lines) > MAX_LINES else []
    return lines[:MAX_LINES] + more
