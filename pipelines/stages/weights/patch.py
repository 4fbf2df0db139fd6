"""The TP3 config patch: pad 64 heads / 8 o_groups to 72 / 9 so tensor parallel 3 divides them.

This file also runs alone, mounted from a ConfigMap into the Kubernetes Job that patches a
member's copy (`python3 patch.py /models/<cacheKey>`): it needs nothing but the standard library.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

try:
    from pipelines.core.errors import BadInput, run_main
except ImportError:  # running alone inside a Job: the same line and exit code, by hand
    BadInput = Exception

    def run_main(main: Callable[[], int]) -> NoReturn:
        """Exit with main's status, or one `error:` line and 2 for a config it refuses."""
        try:
            status = main()
        except PatchError as err:
            print(f"error: {err}", file=sys.stderr)
            sys.exit(2)
        sys.exit(status)


ORIGINAL = {"num_attention_heads": 64, "o_groups": 8}
PADDED = {"num_attention_heads": 72, "o_groups": 9}
ORIG_SUFFIX = ".orig-hf"
# A model's config.json is a few KiB; one past this is not a config, and is never read whole.
CONFIG_MAX_BYTES = 1 << 20
# The patch step's overrides.json names two files: some 200 bytes.
OVERRIDES_MAX_BYTES = 64 << 10


class PatchError(BadInput):
    """A config the TP3 patch must not touch."""


def attention_shape(config: dict[str, Any]) -> dict[str, Any]:
    """text_config's (num_attention_heads, o_groups) as a dict."""
    text = config.get("text_config") or {}
    return {k: text.get(k) for k in ORIGINAL}


def is_tp3_patched(config: dict[str, Any]) -> bool:
    """True when config is already the padded one, with the originals recorded both places."""
    return (
        attention_shape(config) == PADDED
        and config.get("virtual_heads_from") == ORIGINAL
        and config["text_config"].get("virtual_heads_from") == ORIGINAL
    )


def patch_tp3(config: dict[str, Any], where: str = "config.json") -> dict[str, Any]:
    """The padded config (72 heads, 9 o_groups, originals recorded); an already padded one as is.

    Refuses any other shape: padding anything but (64, 8) would serve a broken model.
    """
    if is_tp3_patched(config):
        return config
    shape = attention_shape(config)
    if shape != ORIGINAL:
        raise PatchError(
            f"{where}: text_config (num_attention_heads, o_groups): expected (64, 8) to pad for"
            f" TP3, got ({shape['num_attention_heads']}, {shape['o_groups']})"
        )
    patched = copy.deepcopy(config)
    patched["text_config"].update(PADDED)
    patched["text_config"]["virtual_heads_from"] = dict(ORIGINAL)
    patched["virtual_heads_from"] = dict(ORIGINAL)
    # Some configs mirror the head count at the top level; keep the mirror consistent.
    if patched.get("num_attention_heads") == ORIGINAL["num_attention_heads"]:
        patched["num_attention_heads"] = PADDED["num_attention_heads"]
    return patched


def config_bytes(config: dict[str, Any]) -> bytes:
    """The file bytes of a config: one fixed layout, so one config gives one blob."""
    return (json.dumps(config, indent=2, ensure_ascii=False) + "\n").encode()


def read_config(path: Path) -> dict[str, Any]:
    """A config.json as a dict, or a PatchError naming the file."""
    try:
        with open(path, "rb") as f:
            data = f.read(CONFIG_MAX_BYTES + 1)
        if len(data) > CONFIG_MAX_BYTES:
            raise PatchError(f"{path}: larger than {CONFIG_MAX_BYTES >> 20} MiB; refused unread")
        config = json.loads(data)
    except (OSError, ValueError) as err:
        raise PatchError(f"{path}: cannot read as JSON: {err}") from None
    except RecursionError:  # json's guard against deep nesting
        raise PatchError(f"{path}: cannot read as JSON: nested too deep") from None
    if not isinstance(config, dict):
        raise PatchError(f"{path}: expected a JSON object")
    if not isinstance(config.get("text_config") or {}, dict):
        raise PatchError(f"{path}: text_config: expected a JSON object")
    return config


def read_overrides(path: Path) -> dict[str, str]:
    """The patch step's overrides.json (file name -> blob sha256), or a PatchError naming it:
    restorable from the remote cache, so read as any file from outside."""
    try:
        with open(path, "rb") as f:
            data = f.read(OVERRIDES_MAX_BYTES + 1)
        if len(data) > OVERRIDES_MAX_BYTES:
            raise PatchError(f"{path}: larger than {OVERRIDES_MAX_BYTES} bytes; refused unread")
        overrides = json.loads(data)
    except (OSError, ValueError, RecursionError) as err:
        raise PatchError(f"{path}: cannot read as JSON: {type(err).__name__}: {err}") from None
    if not isinstance(overrides, dict) or not all(
        isinstance(name, str) and isinstance(sha, str) for name, sha in overrides.items()
    ):
        raise PatchError(f"{path}: expected an object of file names to sha256 strings")
    return overrides


def replace_file(path: Path, data: bytes) -> None:
    """Replace path by a new file (temp, fsync, rename): never writes through a hard link.

    The store's write_atomic does the same; this file must run without the package.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def patch_tp3_folder(folder: Path) -> bool:
    """Patch folder/config.json in place, keeping config.json.orig-hf; True when it changed.

    This is what runs against a member's own copy (the Kubernetes Job); every file is
    replaced by rename, never written through, so hard-linked blobs stay intact.
    """
    path = Path(folder) / "config.json"
    config = read_config(path)
    patched = patch_tp3(config, str(path))
    if patched is config:
        return False
    original = path.with_name(path.name + ORIG_SUFFIX)
    if not original.exists():
        replace_file(original, path.read_bytes())
    replace_file(path, config_bytes(patched))
    os.chmod(path, 0o644)
    return True


def main(argv: list[str] | None = None) -> int:
    """`python -m pipelines.stages.weights.patch FOLDER`: apply the TP3 patch to a model folder."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m pipelines.stages.weights.patch MODEL_FOLDER", file=sys.stderr)
        return 2
    changed = patch_tp3_folder(Path(args[0]))
    state = "padded to 72 heads / 9 o_groups" if changed else "already padded"
    print(f"{args[0]}/config.json: {state}")
    return 0


if __name__ == "__main__":
    run_main(main)
