"""The model's signature in the OpenSSF model signing format (the `model-signing` library): a
signed manifest of every locked file's sha256, and the check of a staged folder against it.

The manifest is made from the lock (whose hashes were taken from the bucket's bytes), so signing
reads no model file; verifying hashes the staged folder with the library. The signed manifest
covers the bucket's files as locked: a file this project patches (the TP3 config.json) is
verified through the original it keeps beside it, and the patched bytes against the patch
step's keyed output.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from pipelines.core.errors import PipelineError
from pipelines.core.files import hash_file, read_capped, write_atomic
from pipelines.core.modellock import Lock
from pipelines.stages.weights.modelkeys import ModelPublicKey, ModelSigningKey


def without_package_init(name: str) -> None:
    """Make `name` importable as a package whose __init__ has not run (unless it is imported
    already): its submodules import as usual, each on its own.

    model_signing's __init__ imports its public API whole, the Sigstore signer and verifier
    among it (sigstore, tuf, requests, securesystemslib and boto3 behind it): 0.2 s of a build
    restored from the remote cache (tests/perf/remote_cache.py), for a signing method this
    project never uses. The modules below need nothing of that __init__ (it only imports them).
    """
    if name not in sys.modules:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.submodule_search_locations is None:
            raise ImportError(f"{name}: not an installed package")
        sys.modules[name] = importlib.util.module_from_spec(spec)


without_package_init("model_signing")

from model_signing import hashing as ms_hashing  # noqa: E402
from model_signing import manifest as ms_manifest  # noqa: E402
from model_signing._hashing.hashing import Digest  # noqa: E402

# The key signer and verifier are public only behind a path to a PEM file and a model folder
# to hash; signing a manifest made from the lock needs the classes themselves.
from model_signing._signing import sign_ec_key  # noqa: E402
from model_signing._signing import signing as ms_signing  # noqa: E402
from model_signing._signing.sign_sigstore_pb import Signature  # noqa: E402

# A signature of 54 files is some 10 KiB; one past this is not a signature, and is not parsed.
SIGNATURE_MAX_BYTES = 1 << 20
# The manifest's serialization: one sha256 per file, no symlinks (a staged folder has none).
SERIALIZATION = ms_manifest._FileSerialization("sha256", allow_symlinks=False)


class ModelSignatureError(PipelineError):
    """A model signature that cannot be made or does not verify."""


def lock_manifest(lock: Lock) -> ms_manifest.Manifest:
    """The manifest of the lock's files (name -> sha256), as the library hashes a folder."""
    items = [
        ms_manifest.FileManifestItem(
            path=Path(e.name), digest=Digest("sha256", bytes.fromhex(e.locked_sha256))
        )
        for e in lock.files
    ]
    return ms_manifest.Manifest(lock.model, items, SERIALIZATION)


@contextlib.contextmanager
def pem_path(pem: bytes) -> Iterator[Path]:
    """A path the library reads a PEM from: a pipe, so a secret key never touches a disk."""
    read_fd, write_fd = os.pipe()
    try:
        os.write(write_fd, pem)  # a few hundred bytes: far below a pipe's buffer
        os.close(write_fd)
        write_fd = -1
        yield Path(f"/dev/fd/{read_fd}")
    finally:
        os.close(read_fd)
        if write_fd >= 0:
            os.close(write_fd)


def sign_lock(lock: Lock, key: ModelSigningKey, path: Path) -> None:
    """Sign the lock's manifest with key and write the signature (a sigstore bundle) to path."""
    payload = ms_signing.Payload(lock_manifest(lock))
    with pem_path(key.pem) as pem:
        signature = sign_ec_key.Signer(pem).sign(payload)
    assert isinstance(signature, Signature)
    write_atomic(path, json.dumps(json.loads(signature.bundle.to_json()), indent=2).encode())


def key_hint(path: Path) -> str:
    """The hint of the key a signature names (sha256 of its PEM), read as hostile JSON."""
    if not os.path.lexists(path):
        raise ModelSignatureError(
            f"model signature {path}: missing; run `doit sign_weights` (docs/provenance.md)"
        )
    try:
        # Read here, as a regular file of at most 1 MiB, before the library opens it: a FIFO
        # or a device put there is refused instead of hanging the verification.
        data = read_capped(path, SIGNATURE_MAX_BYTES, ModelSignatureError)
    except ModelSignatureError as err:
        raise ModelSignatureError(f"model signature {err}") from None
    try:
        bundle = json.loads(data)
        hint = bundle["verificationMaterial"]["publicKey"]["hint"]
    except (ValueError, RecursionError, KeyError, TypeError):
        raise ModelSignatureError(
            f"model signature {path}: verificationMaterial.publicKey.hint: expected a sigstore"
            " bundle naming its key"
        ) from None
    if not isinstance(hint, str):
        raise ModelSignatureError(f"model signature {path}: publicKey.hint: expected a string")
    return hint


def signed_manifest(
    path: Path, trusted: dict[str, ModelPublicKey]
) -> tuple[str, ms_manifest.Manifest]:
    """(signer's name, the manifest it signed), verified by the library with the trusted key
    the signature names; one line when none is trusted or the signature does not verify."""
    hint = key_hint(path)
    signer = next((k for k in trusted.values() if k.hint == hint), None)
    if signer is None:
        names = ", ".join(sorted(trusted)) or "none"
        raise ModelSignatureError(
            f"model signature {path}: signed by a key not trusted (key hint {hint[:16]});"
            f" trusted model keys: {names}"
        )
    try:
        with pem_path(signer.pem) as pem:
            manifest = sign_ec_key.Verifier(pem).verify(Signature.read(path))
    except Exception as err:  # the library raises ValueError and its parsers' own errors
        reason = (
            str(err).splitlines()[0][:200]
            if str(err)
            else f"{type(err).__name__}, forged or altered"
        )
        raise ModelSignatureError(
            f"model signature {path}: does not verify with trusted key {signer.name}: {reason}"
        ) from None
    return signer.name, manifest


def digests(manifest: ms_manifest.Manifest) -> dict[str, str]:
    """File name -> sha256 hex of a manifest."""
    return {rd.identifier: rd.digest.digest_hex for rd in manifest.resource_descriptors()}


def manifest_differences(actual: dict[str, str], signed: dict[str, str]) -> list[str]:
    """What differs between two name -> sha256 maps: extra, missing, changed (first few each)."""
    extra = sorted(set(actual) - set(signed))
    missing = sorted(set(signed) - set(actual))
    changed = sorted(n for n in set(actual) & set(signed) if actual[n] != signed[n])
    found = []
    for what, names in (("extra", extra), ("missing", missing), ("hash differs", changed)):
        if names:
            found.append(f"{what}: {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}")
    return found


def check_lock_signed(lock: Lock, signed: ms_manifest.Manifest, path: Path) -> None:
    """Refuse a signature of another lock's files (a valid signature of older weights)."""
    problems = manifest_differences(digests(lock_manifest(lock)), digests(signed))
    if problems:
        raise ModelSignatureError(
            f"model signature {path}: signs other files than the lock of {lock.model}"
            f" ({'; '.join(problems)})"
        )


def original_names(lock: Lock, plan: dict[str, str]) -> dict[str, str]:
    """Locked name -> the staged name holding its original bytes, for each name the plan
    patches (config.json -> config.json.orig-hf)."""
    locked = {e.name: e.locked_sha256 for e in lock.files}
    kept = {sha: name for name, sha in plan.items() if name not in locked}
    return {name: kept.get(sha, name) for name, sha in locked.items() if plan.get(name) != sha}


def folder_view(folder: Path, lock: Lock, plan: dict[str, str], view: Path) -> None:
    """Fill view with symlinks to the folder's files as the bucket holds them: each patched
    name points at the original kept beside it, the originals' own names left out."""
    originals = original_names(lock, plan)
    kept = set(originals.values()) - set(originals)
    for name in sorted(os.listdir(folder)):
        if name in kept:
            continue
        if (folder / name).is_symlink() or not (folder / name).is_file():
            raise ModelSignatureError(f"{folder}: {name}: expected a plain file (staged link)")
        (view / name).symlink_to((folder / originals.get(name, name)).absolute())


def check_folder(
    folder: Path, lock: Lock, plan: dict[str, str], signed: ms_manifest.Manifest, signer: str
) -> None:
    """Hash the staged folder with the library and compare with the signed manifest: every
    file's hash, nothing missing, nothing extra; patched files against the plan's blobs."""
    for name, original in original_names(lock, plan).items():
        if not (folder / original).is_file():
            raise ModelSignatureError(
                f"{folder}: {original}: missing; the original of patched {name} is what the"
                " model signature covers"
            )
        if not (folder / name).is_file() or hash_file(folder / name) != plan[name]:
            raise ModelSignatureError(
                f"{folder}: {name}: not the patch step's output {plan[name][:16]}"
            )
    with tempfile.TemporaryDirectory(prefix="sparkforge-model-view-") as view:
        folder_view(folder, lock, plan, Path(view))
        # Symlinks followed in the view only: it is made of them; the folder itself has none.
        # (The Config's own flag is what hash() applies, not use_file_serialization's.)
        hashing = (
            ms_hashing.Config()  # type: ignore[no-untyped-call]
            .use_file_serialization(hashing_algorithm="sha256")
            .set_allow_symlinks(True)
        )
        actual = hashing.hash(Path(view))
    problems = manifest_differences(digests(actual), digests(signed))
    if problems:
        raise ModelSignatureError(
            f"{folder}: differs from the model manifest signed by {signer} ({'; '.join(problems)})"
        )
