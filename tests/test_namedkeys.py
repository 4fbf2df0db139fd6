"""Named keys (`name:base64`, as Nix writes them): one parser for the remote cache's keys and
the attestations'; several trusted at once; secrets never quoted."""

from __future__ import annotations

import base64
import os
import stat

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from pipelines.core.errors import BadInput
from pipelines.core.settings import read_settings
from pipelines.core.signing.keyring import attestation_signer, deploy_trusted, local_key
from pipelines.core.signing.namedkeys import keygen, public_key, signing_key, trusted_keys

SEED = bytes(range(32))


def named(name: str, raw: bytes) -> str:
    return f"{name}:{base64.b64encode(raw).decode()}"


def public_raw(seed: bytes) -> bytes:
    return Ed25519PrivateKey.from_private_bytes(seed).public_key().public_bytes_raw()


def test_a_secret_key_and_its_public_half_keep_their_name():
    key = signing_key(named("lab-ci-2026", SEED), "environment SPARKFORGE_SIGNING_KEY")
    assert key.public.text == named("lab-ci-2026", public_raw(SEED))
    # Nix's 64-byte form (seed, then public key) is the same key.
    nix = signing_key(named("lab-ci-2026", SEED + public_raw(SEED)), "here")
    assert nix.public.text == key.public.text
    assert "lab-ci-2026" in repr(key) and base64.b64encode(SEED).decode() not in repr(key)


@pytest.mark.parametrize(
    "text",
    [
        base64.b64encode(SEED).decode(),  # no name
        named("x", SEED[:31]),  # too short
        named("x", SEED + bytes(32)),  # 64 bytes whose half is not the public key
        "x:not base64!",
        named("bad name", SEED),
    ],
    ids=["no name", "31 bytes", "wrong public half", "not base64", "space in name"],
)
def test_a_malformed_secret_key_is_one_line_that_never_quotes_it(text):
    with pytest.raises(BadInput) as err:
        signing_key(text, "environment SPARKFORGE_SIGNING_KEY")
    message = str(err.value)
    assert message.startswith("environment SPARKFORGE_SIGNING_KEY: expected name:base64")
    secret = text.rpartition(":")[2]
    assert "\n" not in message and secret[:8] not in message


def test_several_keys_are_trusted_at_once_and_one_name_for_two_keys_is_refused():
    old, new = named("lab-2025", public_raw(SEED)), named("lab-2026", public_raw(bytes(32)))
    keys = trusted_keys([old, new, old], "environment SPARKFORGE_TRUSTED_KEYS")
    assert sorted(keys) == ["lab-2025", "lab-2026"]
    clash = named("lab-2025", public_raw(bytes(32)))
    with pytest.raises(BadInput, match="'lab-2025' is given for two different keys"):
        trusted_keys([old, clash], "environment SPARKFORGE_TRUSTED_KEYS")
    with pytest.raises(BadInput, match="'lab-2025:AAEC' is not name:base64 of an ed25519 public"):
        public_key("lab-2025:AAEC", "environment SPARKFORGE_TRUSTED_KEYS")


def test_keygen_writes_a_mode_600_secret_once_and_prints_the_public_key(tmp_path):
    path = tmp_path / "ci.key"
    public = keygen("lab-ci", path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    secret = signing_key(path.read_text(), str(path))
    assert secret.public.text == public and public.startswith("lab-ci:")
    with pytest.raises(BadInput, match="exists; not overwriting a key"):
        keygen("lab-ci", path)


def test_a_local_stack_signs_with_its_stores_own_key_and_trusts_it(tmp_path):
    settings, keys = read_settings({}), tmp_path / "keys"
    assert attestation_signer(settings, None) is None
    assert deploy_trusted(settings, None) == {}
    own = attestation_signer(settings, keys)
    assert own is not None and own.name == "local-stack"
    assert local_key(keys).public.text == own.public.text  # made once, then read
    assert stat.S_IMODE(os.stat(keys / "local-stack.key").st_mode) == 0o600
    assert deploy_trusted(settings, keys) == {"local-stack": own.public}


def test_the_signing_key_comes_from_the_environment_or_a_named_file(tmp_path):
    path = tmp_path / "k"
    path.write_text(named("from-file", SEED))
    by_file = read_settings({"SPARKFORGE_SIGNING_KEY_FILE": str(path)})
    assert attestation_signer(by_file, tmp_path).name == "from-file"  # type: ignore[union-attr]
    by_env = read_settings({"SPARKFORGE_SIGNING_KEY": named("from-env", SEED)})
    assert "from-env" not in repr(by_env) and attestation_signer(by_env, None).name == "from-env"  # type: ignore[union-attr]
    missing = read_settings({"SPARKFORGE_SIGNING_KEY_FILE": str(tmp_path / "none")})
    with pytest.raises(BadInput, match=r"SPARKFORGE_SIGNING_KEY_FILE=.*none: cannot read"):
        attestation_signer(missing, None)
