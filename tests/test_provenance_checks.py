"""The deploy's image check on hostile attestations, without services: every malformed or
misdirected envelope is one line naming the image, never a traceback or a pass."""

from __future__ import annotations

import json

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from support.attestations import envelope

from pipelines.core.signing.namedkeys import PublicKey
from pipelines.stages.provenance import check_image

SEED = bytes(range(32))
DIGEST = "sha256:" + "ab" * 32
REF = f"registry.example/lab/local-sim@{DIGEST}"
KEY = "cd" * 32
TRUSTED = {"lab": PublicKey("lab", Ed25519PrivateKey.from_private_bytes(SEED).public_key())}


def statement(**changes) -> dict:
    """A Statement the check accepts, with changes."""
    value = {
        "_type": "https://in-toto.io/Statement/v1",
        "subject": [{"name": "x", "digest": {"sha256": DIGEST[7:]}}],
        "predicateType": "https://slsa.dev/provenance/v1",
        "predicate": {"buildDefinition": {"externalParameters": {"key": KEY}}},
    }
    return {**value, **changes}


def test_a_good_attestation_passes():
    assert check_image(REF, envelope(statement(), "lab", SEED), KEY, TRUSTED).problem is None


def retyped(kind: str) -> bytes:
    """A good envelope whose payload type is kind."""
    data = json.loads(envelope(statement(), "lab", SEED))
    data["payloadType"] = kind
    return json.dumps(data).encode()


@pytest.mark.parametrize(
    ("data", "said"),
    [
        (b"\xff not json", "not a DSSE envelope"),
        (b"[]", "not a DSSE envelope"),
        (b'{"payload": 1, "payloadType": "x", "signatures": "no"}', "not a DSSE envelope"),
        (b"[" * 100000, "not a DSSE envelope"),
        (b" " * (1 << 20) + b"{}", "over the 1048576 an envelope may be"),
        (retyped("text/plain"), "payload type 'text/plain'"),
        (envelope(statement(subject="everything"), "lab", SEED), "is about none"),
        (envelope(statement(predicateType="x"), "lab", SEED), "predicate 'x'"),
        (envelope(statement(predicate=[]), "lab", SEED), "records inputs key none"),
    ],
    ids=[
        "not JSON",
        "a list",
        "fields of the wrong type",
        "nested too deep",
        "oversized",
        "not in-toto",
        "subject not a list",
        "another predicate",
        "predicate not an object",
    ],
)
def test_a_malformed_attestation_is_one_line_naming_the_image(data, said):
    problem = check_image(REF, data, KEY, TRUSTED).problem
    assert problem is not None and problem.startswith(f"image {REF}: ") and said in problem
    assert "\n" not in problem
