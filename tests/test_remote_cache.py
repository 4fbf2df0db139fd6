"""The remote cache on the local stack's S3, as runners use it: `doit build profile=local` in
store folders that share one signed cache (each test under a prefix of its own)."""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from support.doit import run_doit

from pipelines.core.errors import PipelineError
from pipelines.core.signing.namedkeys import keygen
from pipelines.engine.keys import canonical_json
from pipelines.engine.remote import remote_cache
from pipelines.engine.remote.entries import MAX_INDEX_BYTES, EntryRefused, check_entry, parse_index
from pipelines.engine.remote.signing import cache_signing_key, sign

REPO = Path(__file__).resolve().parent.parent
BUCKET = "models"  # the stack's bucket; every test works under a prefix of its own
STEPS = {"profile", "patch_config", "render"}  # the store-backed steps of the local profile


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    """Two named key pairs, (secret, public) as `name:base64`: trusted, and one nobody trusts."""
    root = tmp_path_factory.mktemp("keys")
    pairs = {}
    for name in ("trusted", "stranger"):
        public = keygen(f"{name}-key", root / name)
        pairs[name] = ((root / name).read_text(), public)
    return pairs


@pytest.fixture(scope="module")
def cache(stack, s3, keys, tmp_path_factory):
    """A cache prefix filled by one writer's build (store A), and what A stored."""
    root = tmp_path_factory.mktemp("remote")
    prefix = f"remote-cache-test-{uuid.uuid4().hex[:8]}"
    world = {"root": root, "prefix": prefix, "weights": root / "weights"}
    first = doit(world, root / "a", prefix, keys["trusted"][0], trusted=keys["trusted"][1])
    assert first.returncode == 0, first.stdout + first.stderr
    assert uploaded(first.stdout) == STEPS
    # The secret never shows, not even in a build's own output.
    assert "PRIVATE KEY" not in first.stdout + first.stderr
    world["first"] = first
    world["store"] = root / "a"
    yield world
    for prefix_used in {prefix, *world.get("copies", [])}:
        delete_prefix(s3, prefix_used)


def doit(
    world, store: Path, prefix: str, signing: str | None, **extra
) -> subprocess.CompletedProcess:
    """`doit build profile=local` with its own store folder, sharing the cache under prefix."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARKFORGE_CACHE")}
    env.update(
        SPARKFORGE_STORE=str(store),
        # Same weights path on every "runner" (as on CI), so render's keys agree.
        SPARKFORGE_WEIGHTS=str(world["weights"]),
        SPARKFORGE_REMOTE_CACHE=f"s3://{BUCKET}/{prefix}",
    )
    env.pop("SPARKFORGE_REGISTRY_NAMESPACE", None)
    if signing:
        env["SPARKFORGE_CACHE_SIGNING_KEY"] = signing
    if "trusted" in extra:
        env["SPARKFORGE_CACHE_TRUSTED_KEYS"] = extra.pop("trusted")
    env.update(extra)
    return run_doit("build", "profile=local", env=env)


def said(output: str, verb: str) -> set[str]:
    """Steps an output line says were `verb` (built, restored, uploaded)."""
    return set(re.findall(rf"^(\w+): {verb} [0-9a-f]{{16}}", output, re.MULTILINE))


def uploaded(output: str) -> set[str]:
    """Steps whose output went to the remote cache."""
    return said(output, "uploaded")


def layer_steps(store: Path) -> set[str]:
    """The keys of a store's normalized image layers: a store that built the image has them,
    one that found the image in the registry (as every reader here does) has none."""
    return {
        folder.name
        for folder in (store / "steps").iterdir()
        if json.loads((folder / "step.json").read_text()).get("name") == "layer"
    }


def tree(store: Path) -> dict[str, str]:
    """Every file under a store's steps/ (its image layers aside), relative path -> sha256."""
    steps, layers = store / "steps", layer_steps(store)
    return {
        str(p.relative_to(steps)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(steps.rglob("*"))
        if p.is_file() and p.relative_to(steps).parts[0] not in layers
    }


def outputs(store: Path) -> dict[str, str]:
    """The step outputs of a store (its records aside: they carry times)."""
    return {k: v for k, v in tree(store).items() if "/out/" in k}


def listing(s3, prefix: str) -> dict[str, int]:
    """Object key -> size under a prefix."""
    found = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix + "/"):
        found.update((o["Key"], o["Size"]) for o in page.get("Contents", []))
    return found


def delete_prefix(s3, prefix: str) -> None:
    """Remove a test's objects."""
    for key in listing(s3, prefix):
        s3.delete_object(Bucket=BUCKET, Key=key)


def copy_cache(s3, world, name: str) -> str:
    """A copy of the filled cache under a new prefix (for a test to break)."""
    prefix = f"{world['prefix']}-{name}-{uuid.uuid4().hex[:6]}"
    world.setdefault("copies", []).append(prefix)
    for key in listing(s3, world["prefix"]):
        s3.copy_object(
            Bucket=BUCKET,
            Key=prefix + key[len(world["prefix"]) :],
            CopySource={"Bucket": BUCKET, "Key": key},
        )
    return prefix


def entry_of(s3, prefix: str, store: Path, step: str) -> tuple[str, dict]:
    """(key, parsed entry) of a step's entry in the cache under prefix."""
    records = list((store / "records" / step).glob("*.json"))
    key = records[0].stem
    body = s3.get_object(Bucket=BUCKET, Key=f"{prefix}/entries/{key}.json")["Body"].read()
    return key, json.loads(body)


def test_second_store_does_no_step_work_and_restores_every_output_verified(cache, keys):
    shutil.rmtree(cache["weights"])  # a runner that starts empty (weights come from their bucket)
    reader = cache["root"] / "b"
    second = doit(cache, reader, cache["prefix"], None, trusted=keys["trusted"][1])
    assert second.returncode == 0, second.stdout + second.stderr
    assert said(second.stdout, "built") == set()
    assert said(second.stdout, "restored") == STEPS
    assert "refused" not in second.stdout
    for step in STEPS:
        assert f"-- {step}" in second.stdout  # up to date: doit ran no step action
    # Every stored output and record, byte for byte the writer's.
    assert tree(reader) == tree(cache["store"])
    assert len(list((reader / "steps").iterdir())) == len(STEPS)
    # The patched config is staged from the restored step, as after a build.
    staged = next((cache["weights"] / "models").iterdir()) / "config.json"
    assert '"num_attention_heads": 72' in staged.read_text()
    # A read-only reader uploads nothing.
    assert uploaded(second.stdout) == set()


OVERSIZED = MAX_INDEX_BYTES + 1
KEY = "a" * 64


def index_of(files: list[dict], dirs: list[str], key: str = KEY) -> dict:
    """A well-formed index for key, of these files and folders."""
    return {"format": 1, "key": key, "record": {"key": key}, "files": files, "dirs": dirs}


def entry_file(path: str) -> dict:
    """An index entry for an empty file at path."""
    return {"path": path, "size": 0, "sha256": hashlib.sha256(b"").hexdigest(), "mode": 0o644}


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"[" * 100_000, "index unreadable (100000 bytes"),
        (b" " * OVERSIZED, f"index of {OVERSIZED} bytes or more, over the {MAX_INDEX_BYTES}"),
    ],
    ids=["nested too deep", "oversized"],
)
def test_an_unreadable_index_is_one_refusal_never_a_crash(data, reason):
    with pytest.raises(EntryRefused) as refused:
        check_entry(data, KEY, {})
    assert str(refused.value).startswith(reason)


@pytest.mark.parametrize(
    ("files", "dirs", "key", "reason"),
    [
        (["a", "a/b"], [], KEY, "index: path 'a/b' is inside 'a', which is a file"),
        (["a"], ["a/c/d"], KEY, "index: path 'a/c/d' is inside 'a', which is a file"),
        (["../outside"], [], KEY, "index: path '../outside' leaves the output folder"),
        (["/etc/passwd"], [], KEY, "index: path '/etc/passwd' leaves the output folder"),
        (["ok"], ["x/./y"], KEY, "index: path 'x/./y' leaves the output folder"),
        (["ok"], [], "b" * 64, "index is for another key"),
    ],
    ids=["file under a file", "folder under a file", "dot-dot", "absolute", "dot", "other key"],
)
def test_a_signed_index_of_a_bad_shape_is_refused(files, dirs, key, reason):
    # Signed by a trusted key or not, the index itself must be safe to restore (a signer's
    # mistake, or a valid entry copied under another step's key).
    with pytest.raises(EntryRefused) as refused:
        parse_index(index_of([entry_file(f) for f in files], dirs, key), KEY, "signer")
    assert str(refused.value) == reason


@pytest.mark.parametrize(
    ("record", "reason"),
    [
        ({"finished": 1.5}, "index: record name 'None': expected a step's name"),
        ({"name": "..", "finished": 1.5}, "index: record name '..': expected a step's name"),
        ({"name": 7, "finished": 1.5}, "index: record name '7': expected a step's name"),
        ({"name": "profile"}, "index: record finished: expected a time in seconds"),
        (
            {"name": "profile", "finished": "now"},
            "index: record finished: expected a time in seconds",
        ),
        (
            {"name": "profile", "finished": math.inf},
            "index: record finished: expected a time in seconds",
        ),
        ({"name": "profile", "finished": 1.5}, None),
    ],
    ids=["no name", "dot-dot name", "number name", "no time", "text time", "endless time", "good"],
)
def test_a_signed_record_is_refused_unless_it_names_its_step_and_its_time(record, reason):
    # Restoring writes the record under records/<name>/ (".." was the store's own folder) and
    # explain sorts records by when they finished.
    index = {**index_of([entry_file("ok")], []), "record": {"key": KEY, **record}}
    if reason is None:
        assert parse_index(index, KEY, "signer").record["name"] == "profile"
        return
    with pytest.raises(EntryRefused) as refused:
        parse_index(index, KEY, "signer")
    assert str(refused.value) == reason


@pytest.mark.parametrize(
    "damage",
    [
        "truncated object",
        "flipped byte",
        "missing object",
        "truncated index",
        "index nested too deep",
        "oversized index",
    ],
)
def test_a_damaged_entry_is_refused_in_one_line_and_rebuilt(cache, keys, s3, tmp_path, damage):
    prefix = copy_cache(s3, cache, damage.replace(" ", "-"))
    key, entry = entry_of(s3, prefix, cache["store"], "render")
    obj = f"{prefix}/objects/sha256/{entry['index']['files'][0]['sha256']}"
    if damage == "truncated object":
        data = s3.get_object(Bucket=BUCKET, Key=obj)["Body"].read()
        s3.put_object(Bucket=BUCKET, Key=obj, Body=data[: len(data) // 2])
    elif damage == "flipped byte":
        data = bytearray(s3.get_object(Bucket=BUCKET, Key=obj)["Body"].read())
        data[len(data) // 2] ^= 1
        s3.put_object(Bucket=BUCKET, Key=obj, Body=bytes(data))
    elif damage == "missing object":
        s3.delete_object(Bucket=BUCKET, Key=obj)
    elif damage == "truncated index":
        data = s3.get_object(Bucket=BUCKET, Key=f"{prefix}/entries/{key}.json")["Body"].read()
        s3.put_object(Bucket=BUCKET, Key=f"{prefix}/entries/{key}.json", Body=data[:100])
    else:  # written by anyone who can write the bucket: no signature needed to be parsed
        body = b"[" * 100_000 if damage == "index nested too deep" else b" " * OVERSIZED
        s3.put_object(Bucket=BUCKET, Key=f"{prefix}/entries/{key}.json", Body=body)
    run = doit(cache, tmp_path / "store", prefix, None, trusted=keys["trusted"][1])
    assert run.returncode == 0, run.stdout + run.stderr
    refusals = [line for line in run.stdout.splitlines() if ": refused " in line]
    assert len(refusals) == 1 and refusals[0].startswith(f"render: remote cache s3://{BUCKET}/")
    expected = {
        "truncated object": "(truncated or grown)",
        "flipped byte": "(corrupted)",
        "missing object": "missing (a partial entry)",
        "truncated index": "index unreadable",
        "index nested too deep": "index unreadable (100000 bytes",
        # Refused on its size, unread (the header's exact size, not "or more" after a read).
        "oversized index": f"index of {OVERSIZED} bytes, over the {MAX_INDEX_BYTES} allowed",
    }[damage]
    assert expected in refusals[0] and refusals[0].endswith("building it here")
    assert said(run.stdout, "built") == {"render"}
    assert said(run.stdout, "restored") == STEPS - {"render"}
    # Rebuilt, never used: the same bytes as the writer's, and no temp folder left behind.
    assert outputs(tmp_path / "store") == outputs(cache["store"])
    assert list((tmp_path / "store" / "tmp").iterdir()) == []


@pytest.mark.parametrize("forgery", ["altered, trusted signer named", "signed by a stranger"])
def test_a_forged_entry_is_refused(cache, keys, s3, tmp_path, forgery):
    prefix = copy_cache(s3, cache, "forged")
    key, entry = entry_of(s3, prefix, cache["store"], "render")
    # The attack: other bytes for the launch plan, with a valid index naming them.
    evil = b"image: attacker.example/evil:latest\n"
    sha = hashlib.sha256(evil).hexdigest()
    s3.put_object(Bucket=BUCKET, Key=f"{prefix}/objects/sha256/{sha}", Body=evil)
    index = entry["index"]
    index["files"][0].update(size=len(evil), sha256=sha)
    parse_index(index, key, "")  # the index itself is valid
    if forgery == "signed by a stranger":
        # A real signature over the altered index, by a key nobody here trusts.
        stranger = cache_signing_key(keys["stranger"][0])
        forged = {
            "index": index,
            "signer": "stranger-key",
            "signature": sign(stranger, canonical_json(index)),
        }
    else:
        forged = entry  # the trusted signer named, its old signature over the altered index
    s3.put_object(
        Bucket=BUCKET, Key=f"{prefix}/entries/{key}.json", Body=json.dumps(forged).encode()
    )
    run = doit(cache, tmp_path / "store", prefix, None, trusted=keys["trusted"][1])
    assert run.returncode == 0, run.stdout + run.stderr
    refusals = [line for line in run.stdout.splitlines() if ": refused " in line]
    assert len(refusals) == 1 and refusals[0].startswith("render: remote cache")
    if forgery == "signed by a stranger":
        assert "signed by stranger-key, a key not trusted here" in refusals[0]
    else:
        assert "signature does not verify" in refusals[0]
    assert said(run.stdout, "built") == {"render"}
    out = next(p for p in (tmp_path / "store" / "steps").glob("*/out/launch-*.yaml"))
    assert b"attacker" not in out.read_bytes()


def test_a_signed_entry_that_cannot_be_restored_here_is_refused_and_built(
    cache, keys, s3, tmp_path
):
    # Valid, signed by the trusted key, and still impossible to write here: a name longer than
    # the filesystem allows. The restore's own error becomes the one refusal line.
    prefix = copy_cache(s3, cache, "unrestorable")
    key, entry = entry_of(s3, prefix, cache["store"], "render")
    index = entry["index"]
    index["files"][0]["path"] = "x" * 300
    trusted = cache_signing_key(keys["trusted"][0])
    signed = {
        "index": index,
        "signer": "trusted-key",
        "signature": sign(trusted, canonical_json(index)),
    }
    s3.put_object(
        Bucket=BUCKET, Key=f"{prefix}/entries/{key}.json", Body=json.dumps(signed).encode()
    )
    run = doit(cache, tmp_path / "store", prefix, None, trusted=keys["trusted"][1])
    assert run.returncode == 0, run.stdout + run.stderr
    refusals = [line for line in run.stdout.splitlines() if ": refused " in line]
    assert (
        len(refusals) == 1
        and "restoring it: OSError: [Errno 36] File name too long" in (refusals[0])
    ), refusals
    assert said(run.stdout, "built") == {"render"}
    assert "Traceback" not in run.stdout + run.stderr


def test_an_object_planted_under_a_files_hash_is_replaced_not_trusted_by_its_size(
    cache, keys, s3, tmp_path
):
    # Before the writer publishes, someone who can write the bucket puts other bytes of the
    # right size under the name of one of the outputs' sha256.
    prefix = f"{cache['prefix']}-planted-{uuid.uuid4().hex[:6]}"
    cache.setdefault("copies", []).append(prefix)
    _, entry = entry_of(s3, cache["prefix"], cache["store"], "render")
    target = entry["index"]["files"][0]
    planted = f"{prefix}/objects/sha256/{target['sha256']}"
    s3.put_object(Bucket=BUCKET, Key=planted, Body=b"x" * target["size"])
    writer = doit(cache, tmp_path / "w", prefix, keys["trusted"][0], trusted=keys["trusted"][1])
    assert writer.returncode == 0, writer.stdout + writer.stderr

    body = s3.get_object(Bucket=BUCKET, Key=planted)["Body"].read()
    assert hashlib.sha256(body).hexdigest() == target["sha256"]  # replaced by the real bytes
    reader = doit(cache, tmp_path / "r", prefix, None, trusted=keys["trusted"][1])
    assert reader.returncode == 0, reader.stdout + reader.stderr
    assert "refused" not in reader.stdout and said(reader.stdout, "restored") == STEPS


@pytest.mark.parametrize("mode", ["SPARKFORGE_CACHE_READONLY=1", "no signing key"])
def test_a_read_only_cache_never_writes(cache, keys, s3, tmp_path, mode):
    prefix = f"{cache['prefix']}-readonly-{uuid.uuid4().hex[:6]}"
    cache.setdefault("copies", []).append(prefix)
    s3.put_object(Bucket=BUCKET, Key=f"{prefix}/marker", Body=b"")
    before = listing(s3, prefix)
    signing = keys["trusted"][0] if mode.startswith("SPARKFORGE") else None
    extra = {"SPARKFORGE_CACHE_READONLY": "1"} if signing else {}
    run = doit(cache, tmp_path / "store", prefix, signing, trusted=keys["trusted"][1], **extra)
    assert run.returncode == 0, run.stdout + run.stderr
    assert said(run.stdout, "built") == STEPS  # nothing to restore: all built here
    assert uploaded(run.stdout) == set()
    assert listing(s3, prefix) == before


def test_settings_are_refused_in_one_line(keys):
    with pytest.raises(PipelineError, match="no key is trusted"):
        remote_cache("s3://models/x", None, (), False)
    with pytest.raises(PipelineError, match="not name:base64 of an ed25519 public key"):
        remote_cache("s3://models/x", None, ("bm90IGEga2V5",), False)
    with pytest.raises(PipelineError, match="expected name:base64 of an ed25519 seed") as err:
        remote_cache("s3://models/x", "not-a-key-but-a-secret", (), False)
    assert "not-a-key-but-a-secret" not in str(err.value)
    # A writer trusts its own key; without a signing key the cache is read-only.
    writer = remote_cache("s3://models/x", keys["trusted"][0], (), False)
    assert writer.writable and "trusted-key" in writer.trusted
    assert keys["trusted"][0].strip().partition(":")[2] not in repr(writer)
    assert not remote_cache("s3://models/x", None, (keys["trusted"][1],), False).writable
    assert not remote_cache("s3://models/x", keys["trusted"][0], (), True).writable


def test_a_restore_killed_or_refused_midway_leaves_no_output(tmp_path):
    from pipelines.engine.remote.entries import EntryRefused
    from pipelines.engine.store import Store

    key = "ab" * 32
    record = {"name": "render", "key": key, "started": 0.0, "finished": 0.0}

    def half_then(fail):
        def fill(out: Path):
            (out / "first.yaml").write_text("written")
            fail()

        return fill

    def refuse():
        raise EntryRefused("object missing (a partial entry)")

    store = Store(tmp_path / "store")
    with pytest.raises(EntryRefused):
        store.restore(key, half_then(refuse))
    assert not store.has(key) and list((store.root / "tmp").iterdir()) == []
    # A restorer killed after writing half: no output, and the next one cleans up after it.
    child = subprocess.run(
        [
            sys.executable,
            "-c",
            "import os, signal, sys; from pathlib import Path;"
            "from pipelines.engine.store import Store;"
            "s = Store(Path(sys.argv[1]));"
            "s.restore(sys.argv[2], lambda out: ((out / 'a').write_text('x'),"
            " os.kill(os.getpid(), signal.SIGKILL)))",
            str(store.root),
            key,
        ],
        cwd=REPO,
    )
    assert child.returncode == -9
    assert not store.has(key) and len(list((store.root / "tmp").iterdir())) == 1
    assert store.restore(key, lambda out: (out / "a").write_text("x") and record)
    assert store.has(key) and list((store.root / "tmp").iterdir()) == []
    assert (store.output_dir(key) / "a").read_text() == "x"


def test_a_file_over_one_part_goes_up_in_checksummed_parts_once(
    keys, s3, s3_in_environment, tmp_path, monkeypatch
):
    # A GB10 layer can be over the 5 GiB one PUT takes: parts, each with its SHA-256, and the
    # stored composite checksum is what lets the next writer skip it.
    from pipelines.engine.remote import remote

    monkeypatch.setattr(remote, "PART", 5 << 20)  # S3's smallest part
    prefix = f"parts-test-{uuid.uuid4().hex[:8]}"
    writer = remote_cache(f"s3://{BUCKET}/{prefix}", keys["trusted"][0], (), False)
    work = tmp_path / "work"
    (work / "out").mkdir(parents=True)
    data = os.urandom((12 << 20) + 7)
    (work / "out" / "layer").write_bytes(data)
    key, sha = "cd" * 32, hashlib.sha256(data).hexdigest()
    record = {"name": "layer", "key": key, "started": 0.0, "finished": 0.0}
    sent: list[int] = []
    upload_part = writer.client.upload_part
    writer.client.upload_part = lambda **kw: sent.append(kw["PartNumber"]) or upload_part(**kw)
    try:
        writer.publish(key, work, record)
        assert sent == [1, 2, 3]
        name = f"{prefix}/objects/sha256/{sha}"
        head = s3.head_object(Bucket=BUCKET, Key=name, ChecksumMode="ENABLED")
        assert head["ContentLength"] == len(data)
        assert head["ChecksumSHA256"].endswith("-3")
        writer.publish(key, work, record)  # a second writer: the bytes are there, nothing sent
        assert sent == [1, 2, 3]
        reader = remote_cache(f"s3://{BUCKET}/{prefix}", None, (keys["trusted"][1],), False)
        (tmp_path / "back").mkdir()
        assert reader.restore(key, tmp_path / "back") == record
        assert (tmp_path / "back" / "layer").read_bytes() == data
    finally:
        delete_prefix(s3, prefix)


def test_a_layer_entry_that_lies_about_its_bytes_is_refused_and_normalized_here(
    keys, s3, s3_in_environment, tmp_path, capsys
):
    import tarfile

    from pipelines.engine.store import Store
    from pipelines.stages.images.layer_cache import LayerCache, layer_key

    layer_tar = tmp_path / "layer.tar"
    with tarfile.open(layer_tar, "w") as tar:
        info = tarfile.TarInfo("etc/hello")
        payload = b"hello\n"
        info.size = len(payload)
        tar.addfile(info, io.BytesIO(payload))
    prefix = f"layer-test-{uuid.uuid4().hex[:8]}"
    url = f"s3://{BUCKET}/{prefix}"
    writer = remote_cache(url, keys["trusted"][0], (), False)
    reader = remote_cache(url, None, (keys["trusted"][1],), False)
    try:
        blob, diff_id, how = LayerCache(Store(tmp_path / "a"), writer).normalize(layer_tar, 0)
        assert how == "normalized"
        blob_b, diff_id_b, how = LayerCache(Store(tmp_path / "b"), reader).normalize(layer_tar, 0)
        assert (how, blob_b.digest, diff_id_b) == ("restored", blob.digest, diff_id)
        assert blob_b.path.read_bytes() == blob.path.read_bytes()

        # The trusted signer's entry for that key now says another diff_id for the same bytes.
        key = layer_key(diff_id)
        lying = tmp_path / "lying"
        shutil.copytree(Store(tmp_path / "a").step_dir(key), lying)
        index = json.loads((lying / "out" / "layer.json").read_text())
        (lying / "out" / "layer.json").write_text(json.dumps({**index, "diff_id": blob.digest}))
        writer.publish(key, lying, json.loads((lying / "step.json").read_text()))
        capsys.readouterr()
        store_c = Store(tmp_path / "c")
        blob_c, diff_id_c, how = LayerCache(store_c, reader).normalize(layer_tar, 0)
        assert (how, blob_c.digest, diff_id_c) == ("normalized", blob.digest, diff_id)
        (line,) = [x for x in capsys.readouterr().out.splitlines() if "refused" in x]
        assert line == (
            f"image: remote cache {url}: refused layer {key[:16]}: blob {blob.digest[:19]}:"
            " its tar is not the diff_id its index says; normalizing it here"
        )

        # ... or holds another layer, whole and consistent, under this layer's key.
        other_tar = tmp_path / "other.tar"
        with tarfile.open(other_tar, "w") as tar:
            info = tarfile.TarInfo("etc/other")
            tar.addfile(info, io.BytesIO(b""))
        LayerCache(Store(tmp_path / "o"), None).normalize(other_tar, 0)
        (other,) = (tmp_path / "o" / "steps").iterdir()
        step = json.loads((other / "step.json").read_text())
        writer.publish(key, other, {**step, "key": key})
        blob_d, _, how = LayerCache(Store(tmp_path / "d"), reader).normalize(layer_tar, 0)
        assert (how, blob_d.digest) == ("normalized", blob.digest)
        (line,) = [x for x in capsys.readouterr().out.splitlines() if "refused" in x]
        assert line.endswith(
            f"its entry is for another layer than {diff_id[:19]}; normalizing it here"
        )
    finally:
        delete_prefix(s3, prefix)


def damaged_layer(tmp_path: Path, damage: str) -> Path:
    """A normalized layer's output folder (blob + layer.json), then damaged one way."""
    import tarfile

    from pipelines.stages.images.oci import normalize_layer

    tar_path, out = tmp_path / "layer.tar", tmp_path / "out"
    out.mkdir(parents=True)
    with tarfile.open(tar_path, "w") as tar:
        info = tarfile.TarInfo("etc/hello")
        info.size = 6
        tar.addfile(info, io.BytesIO(b"hello\n"))
    blob, diff_id = normalize_layer(tar_path, 0, out)
    index = {"digest": blob.digest, "diff_id": diff_id, "size": blob.size}
    if damage == "size":
        index["size"] += 1
    elif damage == "digest":
        index["digest"] = diff_id  # a well-formed digest its bytes do not give
        blob.path.rename(out / diff_id[7:])
    elif damage == "not gzip":
        blob.path.write_bytes(b"x" * blob.size)
    elif damage == "trailing bytes":  # digest and size say the longer bytes: only gzip knows
        longer = blob.path.read_bytes() + b"\0"
        blob.path.unlink()
        index["digest"] = "sha256:" + hashlib.sha256(longer).hexdigest()
        index["size"] = len(longer)
        (out / index["digest"][7:]).write_bytes(longer)
    elif damage == "missing blob":
        blob.path.unlink()
    elif damage == "size a bool":
        index["size"] = True
    elif damage == "diff_id not a digest":
        index["diff_id"] = "sha256:../../etc"
    (out / "layer.json").write_text(json.dumps(index))
    return out


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        ("size", "its bytes are not the digest and size its index says"),
        ("digest", "its bytes are not the digest and size its index says"),
        ("not gzip", "not a gzip stream"),
        ("trailing bytes", "its tar is not the diff_id its index says"),
        ("missing blob", "missing from the entry"),
        ("size a bool", "layer.json: field size: expected a byte count"),
        ("diff_id not a digest", "layer.json: field diff_id: expected sha256:<64 hex>"),
    ],
)
def test_a_restored_layer_is_checked_byte_for_byte(tmp_path, damage, reason):
    from pipelines.stages.images.layer_cache import BadLayer, check_layer

    with pytest.raises(BadLayer) as refused:
        check_layer(damaged_layer(tmp_path, damage))
    assert str(refused.value).endswith(reason)
    check_layer(damaged_layer(tmp_path / "intact", "none"))  # an intact one passes
