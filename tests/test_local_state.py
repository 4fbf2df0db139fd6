"""Bad local state gives one line: YAML capped in size, depth and expansion before it is
composed; a corrupt record is named and left out while the rest is shown; a peer's status is
type-checked, and a bad one counts as the peer having nothing (issue 30, part 5)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
import tracemalloc
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from support.doit import run_doit

from pipelines.core.errors import BadInput, DeployError
from pipelines.core.files import read_capped
from pipelines.core.modellock import LockError, load_lock
from pipelines.core.profiles import PROFILES_DIR, ProfileError, load_profile
from pipelines.core.schema import YAML_MAX_DEPTH, YAML_MAX_NODES
from pipelines.engine.steps import Engine, Step
from pipelines.engine.store import Store
from pipelines.stages.deploy.plan import read_documents
from pipelines.stages.deploy.records import Records
from pipelines.stages.fabric.records import fabric_refusal, fabric_verdict, results_folder
from pipelines.stages.fabric.tasks import FabricDocumentsError, fabric_documents
from pipelines.stages.weights.patch import PatchError, read_config, read_overrides
from pipelines.stages.weights.peerwatch import (
    STATUS_MAX_BYTES,
    BadPeerStatus,
    PeerWatch,
    read_peer_status,
)

SHA = "ab" * 32


def no_traceback(result: subprocess.CompletedProcess[str]) -> None:
    """Neither stream holds a Python traceback."""
    assert "Traceback" not in result.stdout + result.stderr, result.stdout + result.stderr


def doit_here(tmp_path: Path, *args: str, profiles: Path | None = None) -> Any:
    """doit in the checkout with a store and an empty stack folder of its own (and profiles)."""
    env = {**os.environ, "SPARKFORGE_STACK_DIR": str(tmp_path / "no-stack")}
    env["SPARKFORGE_STORE"] = str(tmp_path / "store")
    if profiles is not None:
        env["SPARKFORGE_PROFILES"] = str(profiles)
    return run_doit(*args, env=env)


# --- profiles and locks: size, depth and expansion capped before the parser composes ---------

DEEP = 50_000  # the finding: libyaml's composer overflows the C stack (SIGSEGV)


def write_sparse(path: Path, size: int) -> Path:
    """A file of size bytes that takes no disk (a hole): reading it whole is what costs."""
    with open(path, "wb") as f:
        f.truncate(size)
    return path


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("[" * DEEP + "]" * DEEP, id="flow-50000"),
        pytest.param("- " * DEEP + "x\n", id="block-50000"),
        pytest.param("name: local\nenv: {a: " + "{a: " * DEEP + "}" * (DEEP + 1), id="mapping"),
    ],
)
def test_a_profile_nested_50000_levels_is_one_line_not_a_crash(tmp_path, text):
    folder = tmp_path / "profiles"
    folder.mkdir()
    path = folder / "local.yaml"
    path.write_text(text)
    result = doit_here(tmp_path, "list", "profile=local", profiles=folder)
    no_traceback(result)
    line = f"line {2 if text.startswith('name') else 1}"
    want = f"error: {path}: {line}: nested deeper than {YAML_MAX_DEPTH} levels;"
    assert result.stderr == f"{want} refused before parsing\n"
    assert result.returncode == 2


def test_a_300_mb_profile_is_refused_unread_in_one_line(tmp_path):
    folder = tmp_path / "profiles"
    folder.mkdir()
    path = write_sparse(folder / "local.yaml", 300 << 20)
    result = doit_here(tmp_path, "list", "profile=local", profiles=folder)
    no_traceback(result)
    assert result.stderr == f"error: {path}: larger than 1 MiB; refused unread\n"
    assert result.returncode == 2


def test_a_300_mb_profile_costs_no_more_memory_than_the_cap(tmp_path):
    write_sparse(tmp_path / "local.yaml", 300 << 20)
    tracemalloc.start()
    try:
        with pytest.raises(ProfileError, match=r"local.yaml: larger than 1 MiB; refused unread$"):
            load_profile("local", tmp_path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, f"peak {peak} bytes"


def laughs(levels: int = 7) -> str:
    """Aliases of aliases: ten of the one before at each level (10**levels strings composed)."""
    lines = ['l0: &l0 ["ha", "ha", "ha", "ha", "ha", "ha", "ha", "ha", "ha", "ha"]']
    for n in range(1, levels + 1):
        lines.append(f"l{n}: &l{n} [" + ", ".join([f"*l{n - 1}"] * 10) + "]")
    return "\n".join(lines) + "\n"


def test_aliases_expanding_past_the_bound_are_refused_before_composing(tmp_path):
    text = (PROFILES_DIR / "local.yaml").read_text()
    (tmp_path / "local.yaml").write_text(laughs() + text)
    with pytest.raises(
        ProfileError,
        match=rf"local.yaml: line 6: more than {YAML_MAX_NODES} nodes with aliases expanded;"
        r" refused before parsing$",
    ) as raised:
        load_profile("local", tmp_path)
    assert raised.value.exit_code == 2


def test_an_alias_inside_its_own_value_is_refused(tmp_path):
    text = (PROFILES_DIR / "local.yaml").read_text()
    (tmp_path / "local.yaml").write_text(text + "description: &d [*d]\n")
    with pytest.raises(
        ProfileError, match=r"local.yaml: line \d+: alias \*d inside its own value; refused"
    ):
        load_profile("local", tmp_path)


def test_a_lock_nested_past_the_bound_is_one_line_with_exit_code_2(tmp_path):
    depth = YAML_MAX_DEPTH + 1
    path = tmp_path / "deep.lock.yaml"
    path.write_text("model: m\nsource: s3://b/m\nfiles:\n" + "  - " + "[" * depth + "]" * depth)
    with pytest.raises(
        LockError,
        match=rf"deep.lock.yaml: line 4: nested deeper than {YAML_MAX_DEPTH} levels;"
        r" refused before parsing$",
    ) as raised:
        load_lock(path)
    assert raised.value.exit_code == 2


def test_a_render_output_nested_too_deep_is_one_line(tmp_path):
    (tmp_path / "10-deep.yaml").write_text("- " * (YAML_MAX_DEPTH + 1) + "x\n")
    with pytest.raises(
        DeployError, match=rf"10-deep.yaml: line 1: nested deeper than {YAML_MAX_DEPTH} levels"
    ):
        read_documents(tmp_path)


# --- deployment records: a corrupt one is named, the rest still tell what is deployed -------

GOOD = {
    "outcome": "deployed",
    "finished": 1.0,
    "who": "me",
    "lock_sha256": SHA,
    "git": "abc",
    "deployment": {"key": SHA, "documents": [{"rank": 0}], "image": "r/i@sha256:1", "engines": []},
}


def test_doit_status_names_a_truncated_record_in_one_line(tmp_path):
    folder = tmp_path / "store" / "deployments" / "tp3-ring"
    folder.mkdir(parents=True)
    path = folder / "1700000000000000000.json"
    path.write_text(json.dumps(GOOD)[:60])
    result = doit_here(tmp_path, "status", "profile=tp3-ring")
    no_traceback(result)
    skipped = [line for line in result.stderr.splitlines() if "skipped" in line]
    assert skipped == [f"deploy records: skipped {path}: not valid JSON: ends early (truncated)"]
    assert "status: nothing deployed for tp3-ring" in result.stdout
    assert result.returncode == 0


def test_a_rollback_refuses_when_the_newest_record_cannot_be_read(tmp_path):
    # The unreadable record may be the live deployment's: restoring "the one before" the last
    # readable one could put back what is already serving, or skip one.
    folder = tmp_path / "store" / "deployments" / "tp3-ring"
    folder.mkdir(parents=True)
    other = {**GOOD, "deployment": {**GOOD["deployment"], "key": "e" * 64}}
    (folder / "1700000000000000000.json").write_text(json.dumps(other))
    (folder / "1700000000000000001.json").write_text(json.dumps(GOOD))
    newest = folder / "1700000000000000002.json"
    newest.write_text(json.dumps(GOOD)[:60])
    result = doit_here(tmp_path, "rollback", "profile=tp3-ring")
    no_traceback(result)
    assert result.returncode == 2
    assert (
        f"rollback refused: {newest}: not valid JSON: ends early (truncated); it is newer"
        " than every record that can be read, so what is live is not known: repair or remove"
        " it, then run it again"
    ) in (result.stdout + result.stderr).splitlines()
    assert sorted(p.name for p in folder.iterdir()) == [
        "1700000000000000000.json",
        "1700000000000000001.json",
        "1700000000000000002.json",
    ]  # nothing written: no restore was tried


CORRUPT_RECORDS = {
    "truncated": (json.dumps(GOOD)[:60], "not valid JSON: ends early (truncated)"),
    "not-json": ("{'outcome': 'deployed'}", "not valid JSON: object keys must be strings (byte 1)"),
    "not-an-object": ("[]", "expected a JSON object"),
    "wrong-type": (
        json.dumps({**GOOD, "finished": "yesterday"}),
        "field 'finished': expected `float`, got `str`",
    ),
    "no-key": (
        json.dumps({**GOOD, "deployment": {"image": "x"}}),
        "field 'deployment': object missing required field `key`",
    ),
    "nested": ("[" * 100_000 + "]" * 100_000, "not valid JSON: nested too deep"),
}


@pytest.mark.parametrize("case", CORRUPT_RECORDS)
def test_a_corrupt_deployment_record_is_named_and_the_rest_still_read(tmp_path, capsys, case):
    text, why = CORRUPT_RECORDS[case]
    records = Records(tmp_path)
    good = records.write(GOOD)
    bad = tmp_path / f"{int(good.stem) + 1}.json"
    bad.write_text(text)
    assert [r["file"] for r in records.live()] == [good.name]
    assert [r["file"] for r in records.live()] == [good.name]  # said once, not per read
    assert capsys.readouterr().err == f"deploy records: skipped {bad}: {why}\n"


def test_a_stray_file_among_the_records_is_named_not_a_crash(tmp_path, capsys):
    records = Records(tmp_path)
    good = records.write(GOOD)
    (tmp_path / "notes.json").write_text("{}")
    assert [r["file"] for r in records.history()] == [good.name]
    name = "not a record's name (<time_ns>.json)"
    assert capsys.readouterr().err == f"deploy records: skipped {tmp_path / 'notes.json'}: {name}\n"


def test_a_record_over_the_cap_is_named_unread(tmp_path, capsys):
    records = Records(tmp_path)
    good = records.write(GOOD)
    bad = write_sparse(tmp_path / f"{int(good.stem) + 1}.json", 17 << 20)
    assert [r["file"] for r in records.live()] == [good.name]
    assert (
        capsys.readouterr().err
        == f"deploy records: skipped {bad}: larger than 16 MiB; refused unread\n"
    )


# --- fabric results: a corrupt newest check refuses the bench in one line ------------------


def test_a_truncated_fabric_result_refuses_the_bench_naming_it(tmp_path):
    store = Store(tmp_path / "store")
    folder = results_folder(store, "tp3-ring")
    folder.mkdir(parents=True)
    path = folder / "1700000000000000000.json"
    path.write_text(json.dumps({"outcome": "passed", "render_key": SHA})[:30])
    assert fabric_refusal(store, "tp3-ring", None) == (
        f"fabric: profile tp3-ring: the newest check cannot be read: {path}: not valid JSON:"
        " ends early (truncated); run `doit fabric profile=tp3-ring` again"
    )
    assert fabric_verdict(store, "tp3-ring", None) == (False, None)


def test_a_fabric_result_with_a_field_of_the_wrong_type_is_named(tmp_path):
    store = Store(tmp_path / "store")
    folder = results_folder(store, "tp3-ring")
    folder.mkdir(parents=True)
    path = folder / "1700000000000000000.json"
    path.write_text(json.dumps({"outcome": "failed", "failures": "all of them"}))
    refusal = fabric_refusal(store, "tp3-ring", None)
    assert refusal is not None
    assert f"{path}: field 'failures': expected `array`, got `str`;" in refusal


# --- step records: explain names a corrupt one and explains against the rest --------------

DODO = textwrap.dedent(
    """
    import os
    from pathlib import Path
    from doit import get_var
    from pipelines.engine.steps import Engine, Step
    from pipelines.engine.store import Store

    DOIT_CONFIG = {"dep_file": os.environ["SPARKFORGE_STORE"] + "/doit.sqlite3"}
    ENGINE = Engine(Store(Path(os.environ["SPARKFORGE_STORE"])), root=Path(__file__).parent)

    def greet(run):
        (run.out / "greeting.txt").write_text(run.step.params["greeting"])

    GREET = Step(name="greet", recipe="greet", version=1, doc="write a greeting",
                 action=greet, params={"greeting": get_var("greeting", "hello")})

    def task_greet():
        return ENGINE.task(GREET)
    """
)


def test_doit_explain_names_a_truncated_step_record_and_explains_against_the_rest(tmp_path):
    (tmp_path / "dodo.py").write_text(DODO)
    pyproject = (Path(__file__).parent.parent / "pyproject.toml").read_text()
    (tmp_path / "pyproject.toml").write_text(pyproject[pyproject.index("[tool.doit]") :])
    env = {**os.environ, "SPARKFORGE_STORE": str(tmp_path / "store")}
    for greeting in ("hello", "howdy"):
        assert run_doit("greet", f"greeting={greeting}", env=env, cwd=tmp_path).returncode == 0
    folder = tmp_path / "store" / "records" / "greet"
    newest = max(folder.glob("*.json"), key=lambda p: json.loads(p.read_text())["finished"])
    newest.write_text(newest.read_text()[:40])
    result = run_doit("explain", "greet", "greeting=hi", env=env, cwd=tmp_path)
    no_traceback(result)
    lines = result.stdout.splitlines()
    assert lines[0] == f"greet: skipped a record: {newest}: not valid JSON: ends early (truncated)"
    assert "params.greeting: 'hello' -> 'hi'" in result.stdout  # against the one still readable
    assert result.returncode == 0


class Remote:
    """A writable remote cache that keeps what it is given."""

    name = "remote"
    writable = True

    def __init__(self) -> None:
        self.published: list[str] = []

    def publish(self, key: str, work: Path, record: dict[str, Any]) -> None:
        """Keep the key."""
        self.published.append(key)


def test_a_truncated_step_json_is_not_uploaded_and_named_in_one_line(tmp_path, capsys):
    store = Store(tmp_path / "store")
    remote = Remote()
    engine = Engine(store, tmp_path, remote=remote)  # type: ignore[arg-type]
    step = Step(name="greet", recipe="greet", version=1, doc="", action=lambda run: None)
    path = store.step_dir(SHA) / "step.json"
    path.parent.mkdir(parents=True)
    path.write_text('{"key": "' + SHA[:10])
    engine.upload(step, SHA)
    assert remote.published == []
    assert capsys.readouterr().out == (
        f"greet: not uploaded to remote: {path}: not valid JSON: ends early (truncated)\n"
    )


# --- a peer's status.json: every field used is type-checked; a bad one means nothing --------

BAD_STATUSES = {
    "done-a-string": (b'{"done": "1e99"}', "field 'done': expected `int`, got `str`"),
    "done-a-float": (b'{"done": 1e99}', "field 'done': expected `int`, got `float`"),
    "done-negative": (b'{"done": -1}', "field 'done': expected `int` >= 0"),
    "from-s3-huge": (b'{"from_s3": 1' + b"0" * 30 + b"}", "field 'from_s3': "),
    "published-a-string": (b'{"published": "' + SHA.encode() + b'"}', "field 'published': "),
    "published-a-path": (b'{"published": ["../../x"]}', "field 'published.0': "),
    "complete-a-string": (b'{"complete": "yes"}', "field 'complete': expected `bool`"),
    "knows-complete-strings": (b'{"knows_complete": ["0"]}', "field 'knows_complete.0': "),
    "truncated": (b'{"done": 12', "status.json: not valid JSON: ends early (truncated)"),
    "not-an-object": (b"[1, 2]", "expected `object`, got `array`"),
    "nested": (b'{"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "status.json: "),
    "too-large": (b" " * (5 << 20), "larger than 4 MiB"),
}


@pytest.mark.parametrize("case", BAD_STATUSES)
def test_a_bad_peer_status_is_one_line(case):
    data, said = BAD_STATUSES[case]
    with pytest.raises(BadPeerStatus, match=r"; taken as having nothing$") as raised:
        read_peer_status(data)
    assert said in str(raised.value)
    assert "\n" not in str(raised.value)


class Answer:
    """A peer's HTTP answer, read as urllib3's streamed response is (counting what was read)."""

    def __init__(self, data: bytes, status: int = 200):
        self.status, self._body, self.read_bytes = status, io.BytesIO(data), 0

    def read(self, amt: int | None = None) -> bytes:
        """Up to amt bytes of the body."""
        data = self._body.read(amt)
        self.read_bytes += len(data)
        return data

    def release_conn(self) -> None:
        """Nothing held."""

    def close(self) -> None:
        """The rest of the body is never read."""
        self.closed = True


def polled(data: bytes) -> SimpleNamespace:
    """A member's watch that knew peer 1 had a blob and was done, after peer 1 answers data."""
    answer = Answer(data)
    peer = SimpleNamespace(
        pool=SimpleNamespace(request=lambda *a, **k: answer), base="http://p1", label="p1"
    )
    watch = PeerWatch({1: peer}, {1: "p1"}, 0.1, lambda line: None)  # type: ignore[dict-item]
    watch.statuses = {1: {"published": [SHA], "complete": True, "done": 5, "from_s3": 5}}
    seen = SimpleNamespace(answer=answer, watch=watch)
    try:
        watch.refresh(1)
    except BadPeerStatus as err:
        seen.said = str(err)
    seen.statuses, seen.fetching = watch.statuses, watch.fetching
    return seen


def test_a_peer_answering_done_1e99_counts_as_having_nothing_never_a_type_error():
    stager = polled(b'{"done": "1e99", "published": []}')
    assert (
        stager.said
        == "status.json: field 'done': expected `int`, got `str`; taken as having nothing"
    )
    seen = stager.statuses[1]
    assert not seen.get("published") and not seen.get("complete")
    # What the progress line and the linger loop compute from every peer's status.
    assert sum(s.get("done", 0) for s in stager.statuses.values()) == 0
    assert stager.fetching == {}  # a bad answer is not progress from S3


def test_a_peer_answering_64_mib_is_read_no_further_than_the_cap():
    stager = polled(b" " * (64 << 20))
    assert stager.said == "larger than 4 MiB; taken as having nothing"
    assert stager.answer.read_bytes == STATUS_MAX_BYTES + 1
    assert stager.answer.closed  # its connection is not used again with the rest unread


def test_a_good_peer_status_is_kept_with_its_fields_typed():
    stager = polled(json.dumps({"done": 7, "published": [SHA], "rank": 1}).encode())
    assert not hasattr(stager, "said")
    assert stager.statuses[1]["done"] == 7 and stager.statuses[1]["published"] == [SHA]


# --- a model's config.json, read by the TP3 patch (also alone, in a Job) --------------------


@pytest.mark.parametrize(
    ("data", "said"),
    [
        pytest.param(
            b"[" * 100_000 + b"]" * 100_000, "cannot read as JSON: nested too deep", id="nested"
        ),
        pytest.param(None, "larger than 1 MiB; refused unread", id="too-large"),
        pytest.param(b'{"text_config": [64, 8]}', "text_config: expected a JSON object", id="list"),
    ],
)
def test_a_bad_config_json_is_one_line_for_the_patch(tmp_path, data, said):
    path = tmp_path / "config.json"
    if data is None:
        write_sparse(path, 2 << 20)
    else:
        path.write_bytes(data)
    with pytest.raises(PatchError) as raised:
        read_config(path)
    assert str(raised.value) == f"{path}: {said}"
    assert isinstance(raised.value, BadInput)


@pytest.mark.parametrize(
    ("text", "said"),
    [
        pytest.param('{"config.json": "', "cannot read as JSON: JSONDecodeError: ", id="truncated"),
        pytest.param('{"config.json": 7}', "expected an object of file names", id="not-a-sha"),
        pytest.param('["config.json"]', "expected an object of file names", id="a-list"),
        pytest.param("[" * 30_000, "cannot read as JSON: RecursionError: ", id="nested"),
        pytest.param(" " * (65 << 10), "larger than 65536 bytes; refused unread", id="too-large"),
    ],
)
def test_a_bad_overrides_json_is_one_line(tmp_path, text, said):
    path = tmp_path / "overrides.json"
    path.write_text(text)
    with pytest.raises(PatchError) as raised:
        read_overrides(path)
    assert str(raised.value).startswith(f"{path}: {said}")
    assert "\n" not in str(raised.value) and raised.value.exit_code == 2


def test_a_fabric_document_nested_too_deep_is_one_line(tmp_path):
    (tmp_path / "fabric-0.yaml").write_text("- " * (YAML_MAX_DEPTH + 1) + "x\n")
    with pytest.raises(
        FabricDocumentsError,
        match=rf"fabric-0.yaml: line 1: nested deeper than {YAML_MAX_DEPTH} levels",
    ):
        fabric_documents(tmp_path)


@pytest.mark.parametrize(
    ("size", "text", "said"),
    [
        pytest.param(17 << 20, None, "larger than 16 MiB; refused unread", id="too-large"),
        pytest.param(0, "[" * 100_000, "not a plan written by `doit plan_weights`", id="nested"),
        pytest.param(0, '{"members": [{"rank": "0"', "not a plan written by", id="truncated"),
    ],
)
def test_a_bad_ring_plan_is_one_line_with_exit_code_2(tmp_path, size, text, said):
    plan = tmp_path / "plan.json"
    if text is None:
        write_sparse(plan, size)
    else:
        plan.write_text(text)
    result = subprocess.run(
        [sys.executable, "-m", "pipelines.stages.weights.ring", "--plan", str(plan), "--rank", "0"]
        + ["--root", str(tmp_path / "root")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    no_traceback(result)
    assert result.stderr.startswith(f"error: {plan}: {said}")
    assert result.stderr.count("\n") == 1
    assert result.returncode == 2


def test_a_file_that_reports_no_size_is_still_read_to_the_cap():
    status = Path("/proc/self/status")  # st_size 0, as a pipe's or a growing file's may be
    assert read_capped(status, 1 << 20, BadInput).startswith(b"Name:")
    with pytest.raises(
        BadInput, match=r"^/proc/self/status: larger than 10 bytes; refused unread$"
    ):
        read_capped(status, 10, BadInput)
