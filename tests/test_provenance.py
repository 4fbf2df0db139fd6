"""Image provenance on the local stack's real registry: `doit image` attaches a signed in-toto
attestation (SLSA v1) beside the image, in-toto's own verifier accepts it, and `doit deploy`
refuses, in one line and before touching the member, an image without one, signed by a key
not trusted, about another digest, or built from other inputs.

The hostile attestations are made here by hand (the DSSE PAE signed with `cryptography`,
pushed with plain HTTP calls), not with the project's signing code."""

from __future__ import annotations

import base64
import hashlib
import json

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from support.attestations import attach, attached, envelope, local_key, pae, statement_of
from support.deploying import derived_image, doit, member, records, tag_digest

from pipelines.core.modellock import cache_key

pytestmark = pytest.mark.stack


@pytest.fixture(scope="module")
def built(world):
    """The test profile's image built, pushed and deployed once: (digest, inputs key, its
    statement)."""
    result = doit(world, "deploy")
    assert result.returncode == 0, result.stdout + result.stderr
    plan = doit(world, "plan")
    assert plan.returncode == 0, plan.stdout + plan.stderr
    key = json.loads(plan.stdout[plan.stdout.index("{") : plan.stdout.rindex("}") + 1])["key"]
    digest = tag_digest(world, f"key-{key[:32]}")
    data = attached(world, digest)
    assert data is not None, "no attestation beside the pushed image"
    return digest, key, statement_of(data)


def refusal(world, docker_client, digest: str) -> str:
    """Deploy digest over the deployed image; assert it was refused with the member untouched
    and return the refusal line."""
    before = member(docker_client, world["name"]).id
    result = doit(world, "deploy", f"image_digest={digest}")
    out = result.stdout + result.stderr
    assert result.returncode == 1 and "Traceback" not in out, out
    lines = [line for line in out.splitlines() if "provenance refused, nothing touched" in line]
    assert len(lines) == 1, out
    assert member(docker_client, world["name"]).id == before
    assert records(world)[-1]["outcome"] == "refused"
    return lines[0]


def test_the_pushed_image_carries_an_attestation_that_in_toto_verifies(world, built):
    from in_toto.models.metadata import Envelope
    from securesystemslib.signer import SSlibKey

    digest, key, statement = built
    assert statement["_type"] == "https://in-toto.io/Statement/v1"
    assert statement["predicateType"] == "https://slsa.dev/provenance/v1"
    assert [s["digest"]["sha256"] for s in statement["subject"]] == [digest[7:]]
    definition = statement["predicate"]["buildDefinition"]
    assert definition["externalParameters"]["key"] == key
    # Every input the key is made of is recorded, exactly: the key is recomputed from the
    # attestation alone (sha256 of the canonical JSON of recipe, version, params, inputs, deps).
    external, resolved = definition["externalParameters"], definition["resolvedDependencies"]
    digests = {d["name"]: d["digest"]["sha256"] for d in resolved}
    material = {
        "recipe": external["recipe"],
        "version": external["version"],
        "params": external["params"],
        "inputs": {n[6:]: v for n, v in digests.items() if n.startswith("input:")},
        "deps": {"base": "sha256:" + digests["dep:base"]},
    }
    canonical = json.dumps(material, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    assert hashlib.sha256(canonical.encode()).hexdigest() == key
    run = statement["predicate"]["runDetails"]
    assert run["builder"]["id"] and run["metadata"]["startedOn"] <= run["metadata"]["finishedOn"]
    # In-toto's own verifier, given only the public half of the store's key.
    name, seed = local_key(world)
    public = Ed25519PrivateKey.from_private_bytes(seed).public_key()
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    sslib = SSlibKey(name, "ed25519", "ed25519", {"public": raw.hex()})
    data = attached(world, digest)
    Envelope.from_dict(json.loads(data)).verify_signature(sslib.to_dict() | {"keyid": name})
    # And by hand: the signature is over DSSE's PAE of the payload.
    parsed = json.loads(data)
    (signature,) = parsed["signatures"]
    public.verify(base64.b64decode(signature["sig"]), pae(base64.b64decode(parsed["payload"])))


def test_doit_provenance_says_who_built_the_image_and_that_each_check_passes(world, built):
    digest, key, _ = built
    result = doit(world, "provenance")
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    report = json.loads(out[out.index("{") : out.rindex("}") + 1])
    assert report["image"].endswith(f"@{digest}") and report["inputs_key"] == key
    assert report["signed_by"] == "local-stack" and report["checks"]["attestation"].startswith(
        "passes"
    )


def test_an_unattested_image_is_refused_before_any_member_is_touched(world, built, docker_client):
    unattested = derived_image(world, docker_client, "unattested", attest=False)
    line = refusal(world, docker_client, unattested)
    assert f"@{unattested}: no attestation in the registry" in line


def test_an_image_attested_with_inputs_of_another_commit_is_refused(world, built, docker_client):
    _, _, statement = built
    other = derived_image(world, docker_client, "othercommit", attest=False)
    stale = json.loads(json.dumps(statement))
    stale["subject"][0]["digest"]["sha256"] = other[7:]
    stale["predicate"]["buildDefinition"]["externalParameters"]["key"] = "f" * 64
    stale["predicate"]["buildDefinition"]["externalParameters"]["source"]["commit"] = "0badc0ffee00"
    attach(world, other, envelope(stale, *local_key(world)))
    line = refusal(world, docker_client, other)
    assert f"@{other}: attestation records inputs key ffffffffffffffff" in line


@pytest.mark.parametrize(
    ("keyid", "said"),
    [
        ("stranger", "attestation refused: signed by 'stranger', not a trusted key"),
        ("local-stack", "attestation refused: signature by local-stack does not verify"),
    ],
    ids=["untrusted key", "forged with the trusted key's name"],
)
def test_an_attestation_resigned_by_another_key_is_refused(
    world, built, docker_client, keyid, said
):
    _, _, statement = built
    other = derived_image(world, docker_client, keyid, attest=False)
    resigned = json.loads(json.dumps(statement))
    resigned["subject"][0]["digest"]["sha256"] = other[7:]
    attach(world, other, envelope(resigned, keyid, bytes(range(32))))
    line = refusal(world, docker_client, other)
    assert said in line


def test_an_attestation_whose_subject_is_another_digest_is_refused(world, built, docker_client):
    digest, _, statement = built
    other = derived_image(world, docker_client, "swapped", attest=False)
    # The genuine attestation of the built image, copied beside another image.
    attach(world, other, envelope(statement, *local_key(world)))
    line = refusal(world, docker_client, other)
    assert f"attestation is about {digest[:19]}, not the digest deployed" in line


def staged_model(world):
    """The test profile's staged model folder in its store."""
    return world["store"] / "weights" / "models" / cache_key(world["profile"]["model"]["source"])


def test_doit_provenance_reports_the_model_signature_passing(world, built):
    result = doit(world, "provenance")
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    report = json.loads(out[out.index("{") : out.rindex("}") + 1])
    assert report["checks"]["model_signature"].startswith("passes: signed by a trusted model key")


def test_a_staged_model_file_changed_after_the_build_is_refused_before_any_member_is_touched(
    world, built, docker_client
):
    digest, _, _ = built
    shard = staged_model(world) / "model-00007-of-00048.safetensors"
    before = member(docker_client, world["name"]).id
    # Changed after the build (a build would fetch and stage it again): the deploy alone, `-s`.
    with open(shard, "r+b") as f:
        f.seek(4096)
        byte = f.read(1)
        f.seek(4096)
        f.write(bytes([byte[0] ^ 0xFF]))
    try:
        result = doit(world, "-s", "deploy", f"image_digest={digest}")
        report = doit(world, "provenance").stdout
    finally:
        with open(shard, "r+b") as f:
            f.seek(4096)
            f.write(byte)
    out = result.stdout + result.stderr
    assert result.returncode == 1 and "Traceback" not in out, out
    lines = [line for line in out.splitlines() if "provenance refused, nothing touched" in line]
    assert lines == [
        f"provenance refused, nothing touched: {staged_model(world)}: differs from the model"
        " manifest signed by local-stack-model (hash differs: model-00007-of-00048.safetensors)"
    ], out
    assert member(docker_client, world["name"]).id == before
    assert records(world)[-1]["outcome"] == "refused"
    assert "hash differs: model-00007-of-00048.safetensors" in report
