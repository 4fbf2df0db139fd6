"""The model's signature (stages/weights/signature.py): the local profile's synthetic model,
made small on disk, signed from its lock and its staged folder verified with the OpenSSF model
signing library; each refusal one line; the library's own CLI accepts what the project signs."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipelines.core.errors import BadInput
from pipelines.core.modellock import Lock, LockEntry
from pipelines.core.settings import read_settings
from pipelines.stages.weights.modelkeys import (
    generate_model_key,
    local_model_key,
    model_public_key,
    model_signer,
    model_signing_key,
    model_trusted,
    trusted_model_keys,
)
from pipelines.stages.weights.signature import (
    ModelSignatureError,
    check_folder,
    check_lock_signed,
    sign_lock,
    signed_manifest,
)
from pipelines.stages.weights.synthetic import SyntheticShape, shard_chunks, shard_name, small_files

SOURCE = "s3://models/test/DeepSeek-V4.1-Flash-synthetic"
# The synthetic model's files, tiny: three shards are enough to have something to miss.
SHAPE = SyntheticShape(shard_bytes=2048, engram_bytes=4096)
MODEL_SIGNING_CLI = Path(sys.executable).with_name("model_signing")


def synthetic_folder(folder: Path) -> Lock:
    """Write a small synthetic model into folder; its lock, hashed here by hashlib."""
    folder.mkdir()
    files = dict(small_files(SHAPE))
    for n in (1, 2, 3):
        files[shard_name(n)] = b"".join(shard_chunks(SHAPE, n, chunk=4096))
    for name, data in files.items():
        (folder / name).write_bytes(data)
    entries = [
        LockEntry(name=name, size=len(data), sha256=hashlib.sha256(data).hexdigest())
        for name, data in files.items()
    ]
    return Lock(model="dsv41-flash-synthetic", source=SOURCE, files=entries)


def plain_plan(lock: Lock) -> dict[str, str]:
    """The staging plan of an unpatched model: the lock's names and hashes."""
    return {e.name: e.locked_sha256 for e in lock.files}


@pytest.fixture
def signed(tmp_path):
    """(folder, lock, signature path, signer) of a synthetic model signed by a fresh key."""
    lock = synthetic_folder(tmp_path / "model")
    key = generate_model_key("lab-model-2026")
    signature = tmp_path / "model.sig"
    sign_lock(lock, key, signature)
    return tmp_path / "model", lock, signature, key


def verify(folder: Path, lock: Lock, signature: Path, trusted, plan=None) -> None:
    """What a deploy checks: the signature by a trusted key, of this lock, and the folder."""
    signer, manifest = signed_manifest(signature, trusted)
    check_lock_signed(lock, manifest, signature)
    check_folder(folder, lock, plan or plain_plan(lock), manifest, signer)


def test_a_signed_synthetic_model_verifies_and_names_its_signer(signed):
    folder, lock, signature, key = signed
    trusted = trusted_model_keys([key.public.text], "test")
    signer, manifest = signed_manifest(signature, trusted)
    assert signer == "lab-model-2026"
    assert {rd.identifier for rd in manifest.resource_descriptors()} == {e.name for e in lock.files}
    verify(folder, lock, signature, trusted)
    # The secret never reaches the signature: only the public key's hint does.
    assert key.text.split(":")[1] not in signature.read_text()


def refusal(folder, lock, signature, trusted, plan=None) -> str:
    """The one line a verification refuses with."""
    with pytest.raises(ModelSignatureError) as err:
        verify(folder, lock, signature, trusted, plan)
    line = str(err.value)
    assert "\n" not in line
    return line


def test_a_file_whose_bytes_differ_from_the_signed_hash_is_refused(signed):
    folder, lock, signature, key = signed
    shard = folder / shard_name(2)
    data = bytearray(shard.read_bytes())
    data[100] ^= 1
    shard.write_bytes(data)
    line = refusal(folder, lock, signature, trusted_model_keys([key.public.text], "t"))
    assert line.endswith(f"(hash differs: {shard_name(2)})")


def test_a_manifest_signed_with_one_files_hash_changed_is_refused(signed, tmp_path):
    folder, lock, _, key = signed
    entries = list(lock.files)
    entries[0] = LockEntry(name=entries[0].name, size=entries[0].size, sha256="0" * 64)
    other = Lock(model=lock.model, source=lock.source, files=entries)
    signature = tmp_path / "other.sig"
    sign_lock(other, key, signature)
    trusted = trusted_model_keys([key.public.text], "t")
    # The folder against it: that file's bytes are not what was signed.
    signer, manifest = signed_manifest(signature, trusted)
    with pytest.raises(ModelSignatureError, match=r"\(hash differs: config.json\)$"):
        check_folder(folder, lock, plain_plan(lock), manifest, signer)
    # And the lock deployed against it: a signature of other files.
    line = refusal(folder, lock, signature, trusted)
    assert "signs other files than the lock" in line and "hash differs: config.json" in line


def test_a_file_added_to_the_staged_folder_is_refused(signed):
    folder, lock, signature, key = signed
    (folder / "extra.safetensors").write_bytes(b"not signed")
    line = refusal(folder, lock, signature, trusted_model_keys([key.public.text], "t"))
    assert line.endswith("(extra: extra.safetensors)")


def test_a_file_removed_from_the_staged_folder_is_refused(signed):
    folder, lock, signature, key = signed
    (folder / shard_name(3)).unlink()
    line = refusal(folder, lock, signature, trusted_model_keys([key.public.text], "t"))
    assert line.endswith(f"(missing: {shard_name(3)})")


def test_a_signature_by_a_key_not_trusted_is_refused_naming_the_trusted(signed):
    folder, lock, signature, _ = signed
    other = generate_model_key("other-lab")
    line = refusal(folder, lock, signature, trusted_model_keys([other.public.text], "t"))
    assert "signed by a key not trusted" in line and line.endswith("trusted model keys: other-lab")


def test_a_signature_naming_a_trusted_key_but_made_by_another_is_refused(signed, tmp_path):
    folder, lock, _, key = signed
    forger = generate_model_key("lab-model-2026")
    forged = tmp_path / "forged.sig"
    sign_lock(lock, forger, forged)
    bundle = json.loads(forged.read_text())
    bundle["verificationMaterial"]["publicKey"]["hint"] = key.public.hint
    forged.write_text(json.dumps(bundle))
    line = refusal(folder, lock, forged, trusted_model_keys([key.public.text], "t"))
    assert "does not verify with trusted key lab-model-2026" in line


def test_a_signature_that_is_not_a_bundle_is_refused_in_one_line(signed):
    folder, lock, signature, key = signed
    trusted = trusted_model_keys([key.public.text], "t")
    signature.write_text("[" * 100_000)
    assert "expected a sigstore bundle" in refusal(folder, lock, signature, trusted)
    signature.unlink()
    assert "missing; run `doit sign_weights`" in refusal(folder, lock, signature, trusted)


def test_a_signature_that_is_a_fifo_or_a_device_is_refused_at_once_not_waited_on(signed):
    folder, lock, signature, key = signed
    trusted = trusted_model_keys([key.public.text], "t")
    signature.unlink()
    os.mkfifo(signature)  # nobody writes it: an open for reading would wait forever
    started = time.monotonic()
    line = refusal(folder, lock, signature, trusted)
    assert time.monotonic() - started < 5
    assert line == f"model signature {signature}: a FIFO, expected a regular file"
    signature.unlink()
    signature.symlink_to("/dev/zero")  # endless bytes: never read past the cap
    line = refusal(folder, lock, signature, trusted)
    assert line == f"model signature {signature}: a character device, expected a regular file"


def test_a_tp3_staged_folder_verifies_through_its_kept_original(signed):
    folder, lock, signature, key = signed
    original = (folder / "config.json").read_bytes()
    (folder / "config.json.orig-hf").write_bytes(original)
    patched = original.replace(b'"num_attention_heads": 64', b'"num_attention_heads": 72')
    (folder / "config.json").write_bytes(patched)
    plan = plain_plan(lock)
    plan["config.json"] = hashlib.sha256(patched).hexdigest()
    plan["config.json.orig-hf"] = lock.entry("config.json").locked_sha256
    trusted = trusted_model_keys([key.public.text], "t")
    verify(folder, lock, signature, trusted, plan)
    # The patched file must be the patch step's output; the original must be what was signed.
    (folder / "config.json").write_bytes(patched + b" ")
    assert "config.json: not the patch step's output" in refusal(
        folder, lock, signature, trusted, plan
    )
    (folder / "config.json").write_bytes(patched)
    (folder / "config.json.orig-hf").write_bytes(original + b" ")
    assert refusal(folder, lock, signature, trusted, plan).endswith("(hash differs: config.json)")


def test_the_local_model_key_is_made_once_mode_600(tmp_path):
    first = local_model_key(tmp_path / "keys")
    assert local_model_key(tmp_path / "keys").public.text == first.public.text
    assert os.stat(tmp_path / "keys" / "local-stack-model.key").st_mode & 0o777 == 0o600
    assert "key=" not in repr(first) and first.text.split(":")[1] not in repr(first)


@pytest.mark.stack  # the library's CLI, a subprocess of seconds: not the fast lane
def test_the_model_signing_cli_accepts_what_the_project_signs_and_refuses_a_changed_byte(signed):
    folder, _, signature, key = signed
    public = signature.with_name("model.pub")
    public.write_bytes(key.public.pem)
    verify_cli = [
        str(MODEL_SIGNING_CLI),
        "verify",
        "key",
        "--public_key",
        str(public),
        "--signature",
        str(signature),
        str(folder),
    ]
    accepted = subprocess.run(verify_cli, capture_output=True, text=True, timeout=120)
    assert accepted.returncode == 0, accepted.stdout + accepted.stderr
    assert "Verification succeeded" in accepted.stdout
    shard = folder / shard_name(1)
    data = bytearray(shard.read_bytes())
    data[64] ^= 0xFF
    shard.write_bytes(data)
    refused = subprocess.run(verify_cli, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 1
    assert f"Hash mismatch for '{shard_name(1)}'" in refused.stdout + refused.stderr


SCALAR = bytes(range(1, 33))


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def test_the_model_key_comes_from_its_own_settings_and_a_local_stack_trusts_its_own(tmp_path):
    path = tmp_path / "k"
    path.write_text(f"from-file:{b64(SCALAR)}")
    by_file = read_settings({"SPARKFORGE_MODEL_SIGNING_KEY_FILE": str(path)})
    assert model_signer(by_file, tmp_path).name == "from-file"  # type: ignore[union-attr]
    # The attestations' settings do not name the model's key.
    assert model_signer(read_settings({"SPARKFORGE_SIGNING_KEY_FILE": str(path)}), None) is None
    missing = read_settings({"SPARKFORGE_MODEL_SIGNING_KEY_FILE": str(tmp_path / "none")})
    with pytest.raises(BadInput) as err:
        model_signer(missing, None)
    assert str(err.value) == (
        f"environment SPARKFORGE_MODEL_SIGNING_KEY_FILE={tmp_path / 'none'}:"
        " cannot read the key file (file not found)"
    )
    local = read_settings({})
    own = model_signer(local, tmp_path / "keys")
    assert own is not None and own.name == "local-stack-model"
    assert model_trusted(local, tmp_path / "keys") == {"local-stack-model": own.public}
    assert model_trusted(local, None) == {}


def test_a_model_key_is_named_p256_its_public_half_compressed_and_its_secret_never_shown():
    key = model_signing_key(f"lab-model-2026:{b64(SCALAR)}", "environment X")
    public = model_public_key(key.public.text, "here")
    assert public.name == "lab-model-2026" and public.hint == key.public.hint
    assert len(base64.b64decode(key.public.text.split(":")[1])) == 33
    assert b64(SCALAR) not in repr(key)


@pytest.mark.parametrize(
    "text",
    [
        f"lab:{b64(bytes(31))}",  # short
        f"lab:{b64(bytes(32))}",  # zero: not a scalar of the curve
        "lab:" + b64(bytes([255]) * 32),  # past the curve's order
        f"lab {b64(SCALAR)}",  # no name
    ],
    ids=["short", "zero", "past the order", "no name"],
)
def test_a_bad_secret_model_key_is_one_line_that_never_quotes_it(text):
    with pytest.raises(BadInput) as err:
        model_signing_key(text, "environment SPARKFORGE_MODEL_SIGNING_KEY")
    assert str(err.value).startswith("environment SPARKFORGE_MODEL_SIGNING_KEY: expected")
    assert text.split(":")[-1] not in str(err.value)


def test_an_ed25519_or_off_curve_public_key_is_not_a_trusted_model_key():
    with pytest.raises(BadInput, match="is not name:base64 of a P-256 public key"):
        trusted_model_keys([f"lab:{b64(bytes(32))}"], "environment SPARKFORGE_MODEL_TRUSTED_KEYS")
    with pytest.raises(BadInput, match="not a point of P-256"):
        trusted_model_keys(["lab:" + b64(bytes([2]) + bytes([255]) * 32)], "here")


def test_one_name_for_two_model_keys_is_refused_and_several_names_are_trusted():
    first, second = generate_model_key("a"), generate_model_key("b")
    assert set(trusted_model_keys([first.public.text, second.public.text], "t")) == {"a", "b"}
    twin = generate_model_key("a")
    with pytest.raises(BadInput, match="key name 'a' is given for two different keys"):
        trusted_model_keys([first.public.text, twin.public.text], "t")


# Asks the local profile's ModelSignature (store argv[1]) whether the lock is signed, and says
# whether the model signing library had to be loaded to answer.
SIGNED_ASKED = """
import sys
from pathlib import Path
from pipelines.core.modellock import load_lock, lock_path
from pipelines.core.profiles import load_profile
from pipelines.core.settings import read_settings
from pipelines.engine.store import Store
from pipelines.stages.weights.signing import ModelSignature
profile = load_profile("local")
lock = lambda: load_lock(lock_path(profile.model.lock))
signature = ModelSignature(
    profile, Store(Path(sys.argv[1])), read_settings({}), lock, lambda: {}, lambda: []
)
if sys.argv[2:] == ["sign"]:
    signature.sign()
print(signature.signed(), "model_signing" in sys.modules)
"""


def signed_asked(store: Path, *args: str) -> str:
    """`signed()` in a fresh process: 'True False' is signed, without the library loaded."""
    run = subprocess.run(
        [sys.executable, "-c", SIGNED_ASKED, str(store), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if not k.startswith("SPARKFORGE_")},
    )
    assert run.returncode == 0, run.stderr
    return run.stdout.split("\n")[-2]


def test_a_verified_signature_is_not_verified_again_until_what_decides_it_changes(tmp_path):
    store = tmp_path / "store"
    assert signed_asked(store, "sign") == "True True"  # signed, then verified by the library
    assert signed_asked(store) == "True False"  # the no-op check: the verdict, kept
    signature = next((store / "signatures").iterdir())
    data = json.loads(signature.read_text())
    data["signature"] = "AAAA" + data.get("signature", "")[4:]
    signature.write_text(json.dumps(data))  # another signature: asked of the library again
    assert signed_asked(store) == "False True"
    (store / "keys").rename(tmp_path / "other-keys")  # another key trusted: likewise
    assert signed_asked(store, "sign") == "True True"
    assert signed_asked(store) == "True False"
