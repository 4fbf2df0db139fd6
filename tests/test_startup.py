"""Start-up is a feature: listing the tasks or asking doit's help imports no network, crypto,
plotting or Kubernetes library. Counted, not timed: the modules loaded in a fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# What a stage imports where its action runs, never when the graph is listed.
HEAVY = [
    "boto3",
    "botocore",
    "docker",
    "kubernetes",
    "securesystemslib",
    "in_toto_attestation",
    "model_signing",
    "cryptography",
    "matplotlib",
    "google.protobuf",
    "paramiko",
    "jinja2",
]
LOADED = """
import contextlib, io, json, sys
sys.argv = ["doit", *sys.argv[1:]]
from doit.__main__ import main
with contextlib.redirect_stdout(io.StringIO()):
    try:
        main()
    except SystemExit:
        pass
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in HEAVY_ROOTS)))
"""


def python(*args: str, env: dict[str, str] | None = None) -> str:
    """What `python ARGS` printed, run in the checkout (in env, else this process's): it must
    exit 0."""
    run = subprocess.run(
        [sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    return run.stdout


def heavy_modules_after(*args: str) -> list[str]:
    """The heavy libraries' modules a fresh `doit ARGS` process has loaded when it is done."""
    roots = sorted({name.split(".")[0] for name in HEAVY})
    code = f"HEAVY_ROOTS = {roots!r}\n{LOADED}"
    loaded = json.loads(python("-c", code, *args).splitlines()[-1])
    return sorted({m for m in loaded if any(m == h or m.startswith(h + ".") for h in HEAVY)})


@pytest.mark.parametrize(
    "args",
    [("list",), ("list", "profile=tp3-ring"), ("list", "profile=tp4-ring"), ("help", "deploy")],
)
def test_listing_the_tasks_loads_no_heavy_library(args):
    assert heavy_modules_after(*args) == []


# Run at exit after every other handler (atexit runs them last-registered first): what the
# collector is left with when the interpreter's own last collection starts.
AT_EXIT = """
import atexit, contextlib, gc, io, json, sys
atexit.register(lambda: print(json.dumps([gc.get_threshold()[0], gc.get_freeze_count()])))
sys.argv = ["doit", "list"]
from doit.__main__ import main
with contextlib.redirect_stdout(io.StringIO()):
    try:
        main()
    except SystemExit:
        pass
"""


def test_a_doit_process_collects_young_objects_less_often_and_walks_nothing_at_exit():
    threshold, frozen = json.loads(python("-c", AT_EXIT).splitlines()[-1])
    assert threshold == 7000  # ten times the default 700
    # Every object out of the collector's sight: the last collection walks none of them.
    assert frozen > 10_000


def test_the_model_signature_module_loads_none_of_the_sigstore_stack():
    """model_signing's package __init__ (its Sigstore signer and verifier) is not run: signing and
    verifying with a key need none of it (tests/test_model_signature.py does both)."""
    code = (
        "import json, sys\nimport pipelines.stages.weights.signature\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))"
    )
    roots = set(json.loads(python("-c", code)))
    assert "model_signing" in roots and "cryptography" in roots
    assert roots.isdisjoint({"sigstore", "tuf", "requests", "securesystemslib", "boto3"})


ENVELOPE_THEN_S3 = """
import json, sys
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from pipelines.core.signing.envelope import open_envelope, sign_statement
from pipelines.core.signing.namedkeys import SigningKey
private = Ed25519PrivateKey.generate()
key = SigningKey("k", private)
public = key.public
opened = open_envelope(sign_statement(b'{"_type": "x"}', key), {"k": public})
loaded = sorted({m.split(".")[0] for m in sys.modules} & {"boto3", "botocore"})
from pipelines.core.s3 import make_client  # the process's S3 clients: boto3 as usual after
client = make_client(None)
print(json.dumps([opened.signer, loaded, type(client).__name__]))
"""


def test_signing_and_opening_an_envelope_load_no_boto3_and_s3_clients_still_do():
    """securesystemslib's signer package would load boto3 for its AWS KMS signer (some 0.15 CPU s
    of every deploy that checks an attestation): held back while it loads, then boto3 loads for
    the process's own S3 clients as before."""
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x", "AWS_REGION": "x"}
    said = python("-c", ENVELOPE_THEN_S3, env=env)
    assert json.loads(said.splitlines()[-1]) == ["k", [], "S3"]


S3_CLIENTS = """
import json, sys
from pipelines.engine.remote.remote import RemoteCache
from pipelines.stages.weights.s3 import s3_client
weights, cache = s3_client(), RemoteCache("s3://cache/prefix", {}).client
loaded = "OpenSSL" in sys.modules
import urllib3.contrib.pyopenssl  # held back only while botocore loaded
print(json.dumps([type(weights).__name__, type(cache).__name__, loaded, "OpenSSL" in sys.modules]))
"""


def test_the_s3_clients_load_no_pyopenssl_and_leave_it_importable():
    """botocore would import urllib3's pyOpenSSL module (and pyOpenSSL) for urllib3's own
    SSLContext: held back while botocore loads, so a process that makes S3 clients skips it;
    a later import of it works as usual. No request is made."""
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x", "AWS_REGION": "x"}
    said = python("-c", S3_CLIENTS, env=env)
    assert json.loads(said.splitlines()[-1]) == ["S3", "S3", False, True]


def test_the_s3_clients_of_a_run_load_the_service_model_once_and_follow_the_environment(
    monkeypatch,
):
    """The model bucket's client and the remote cache's come from one boto3 session (the S3
    service model read once); another AWS_* environment gets a session, and credentials, of its
    own. No request is made: making a client needs no server."""
    import botocore.loaders

    from pipelines.engine.remote.remote import RemoteCache
    from pipelines.stages.weights.s3 import s3_client

    read: list[str] = []
    load_file = botocore.loaders.JSONFileLoader.load_file

    def counted(self, file_path, *args):
        read.append(str(file_path))
        return load_file(self, file_path, *args)

    monkeypatch.setattr(botocore.loaders.JSONFileLoader, "load_file", counted)
    for name in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", f"first-{uuid.uuid4().hex}")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    weights = s3_client()
    assert any(p.endswith("/s3/2006-03-01/service-2") for p in read), read
    first_client_read = list(read)
    cache = RemoteCache("s3://cache/prefix", {}).client
    assert read == first_client_read  # the second client read no file
    first = os.environ["AWS_ACCESS_KEY_ID"]
    assert weights._request_signer._credentials.access_key == first
    assert cache._request_signer._credentials.access_key == first

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "second")
    assert s3_client()._request_signer._credentials.access_key == "second"


def test_a_doit_process_closes_its_stat_cache_at_exit_though_the_collector_walks_nothing(
    tmp_path,
):
    """The stat cache's connection is closed by hand at exit, so sqlite folds its WAL back into
    the database: no -wal or -shm file is left (one the next run must make again, which fails on
    a full disk: tests/test_steps.py)."""
    store = tmp_path / "store"
    python("-m", "doit", "list", env={**os.environ, "SPARKFORGE_STORE": str(store)})
    assert (store / "statcache.sqlite3").is_file()
    assert sorted(p.name for p in store.glob("statcache.sqlite3-*")) == []


def test_the_benchmark_helper_the_tests_import_loads_no_plotting_library():
    """Every worker's collection imports tests/perf/keying.py (the full-size model's shape):
    its charts' matplotlib loads when a chart is drawn (0.3 s of each collection before), and
    a chart is still drawn."""
    code = (
        "import json, sys\nsys.path.insert(0, 'tests/perf')\nimport keying, plot\n"
        "loaded = sorted({m.split('.')[0] for m in sys.modules} & {'matplotlib', 'PIL'})\n"
        "drawn = plot.bar_chart(sys.argv[1], 't', 's', {'ours': 1.0, 'peer': 2.0})\n"
        "print(json.dumps([loaded, drawn.stat().st_size > 0]))\ndrawn.unlink()"
    )
    said = python("-c", code, f"startup-{uuid.uuid4().hex}")
    assert json.loads(said.splitlines()[-1]) == [[], True]
