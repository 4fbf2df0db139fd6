"""The keyed step engine: keys, the store, the stat cache and doit's use of them."""

import contextlib
import hashlib
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from keying import read_chars
from support.doit import run_doit

from pipelines.engine import statcache
from pipelines.engine.keys import canonical_json, key_material, step_key
from pipelines.engine.statcache import StatCache, stat_key
from pipelines.engine.steps import Engine, Step
from pipelines.engine.store import Store

DODO = textwrap.dedent(
    """
    import os, time
    from pathlib import Path
    from doit import get_var
    from pipelines.engine.steps import Engine, Step
    from pipelines.engine.store import Store

    DOIT_CONFIG = {"dep_file": os.environ["SPARKFORGE_STORE"] + "/doit.sqlite3"}
    ENGINE = Engine(Store(Path(os.environ["SPARKFORGE_STORE"])), root=Path(__file__).parent)
    RUNS = Path(__file__).parent / "runs.log"

    def greet(run):
        with RUNS.open("a") as f:
            f.write(run.step.params["greeting"] + "\\n")
        text = run.step.params["greeting"] + " " + Path("name.txt").read_text()
        out = run.out / "greeting.txt"
        with out.open("w") as f:
            f.write(text[:3])
            f.flush()
            if Path("hold").exists():  # a test holds the step mid-write until it removes hold
                Path("writing").touch()
                while Path("hold").exists():
                    time.sleep(0.02)
            f.write(text[3:])

    GREET = Step(name="greet", recipe="greet", version=1, doc="write a greeting",
                 action=greet, params={"greeting": get_var("greeting", "hello")},
                 inputs={"name": Path("name.txt")})

    def task_greet():
        return ENGINE.task(GREET)
    """
)


def make_project(tmp_path: Path) -> tuple[Path, dict]:
    """A folder with a one-step dodo.py and its input, and the env that points at its store."""
    (tmp_path / "dodo.py").write_text(DODO)
    # The project's own doit settings (sqlite3 backend, the explain command) apply here too.
    pyproject = (Path(__file__).parent.parent / "pyproject.toml").read_text()
    (tmp_path / "pyproject.toml").write_text(pyproject[pyproject.index("[tool.doit]") :])
    (tmp_path / "name.txt").write_text("world")
    env = {**os.environ, "SPARKFORGE_STORE": str(tmp_path / "store")}
    return tmp_path, env


def doit(project: Path, env: dict, *args: str) -> subprocess.CompletedProcess:
    """Run doit in the project folder and return the finished process."""
    return run_doit(*args, env=env, cwd=project)


def runs(project: Path) -> list[str]:
    """The greetings the step's action was actually run for, in order."""
    log = project / "runs.log"
    return log.read_text().split() if log.exists() else []


def test_returning_to_earlier_parameters_reuses_stored_output(tmp_path):
    project, env = make_project(tmp_path)
    for greeting in ("hello", "howdy", "hello"):
        result = doit(project, env, "greet", f"greeting={greeting}")
        assert result.returncode == 0, result.stderr
    # The second "hello" found its output in the store: doit ran the action twice, not three times.
    assert runs(project) == ["hello", "howdy"]
    assert "-- greet" in result.stdout


def test_changed_input_file_changes_the_key_and_explain_names_it(tmp_path):
    project, env = make_project(tmp_path)
    assert doit(project, env, "greet").returncode == 0
    assert "up to date" in doit(project, env, "explain", "greet").stdout
    (project / "name.txt").write_text("there")
    explained = doit(project, env, "explain", "greet").stdout
    assert "would run" in explained
    assert "inputs.name:" in explained
    assert doit(project, env, "greet").returncode == 0
    assert runs(project) == ["hello", "hello"]
    assert (project / "store" / "steps").is_dir()


def test_explain_names_a_changed_parameter(tmp_path):
    project, env = make_project(tmp_path)
    assert doit(project, env, "greet").returncode == 0
    explained = doit(project, env, "explain", "greet", "greeting=hi").stdout
    assert "params.greeting: 'hello' -> 'hi'" in explained


def test_step_killed_while_writing_leaves_no_output_and_next_run_completes(tmp_path):
    project, env = make_project(tmp_path)
    (project / "hold").touch()
    proc = subprocess.Popen(
        [sys.executable, "-m", "doit", "greet"],
        cwd=project,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while not (project / "writing").exists():
        assert proc.poll() is None, "the step ended before it started writing"
        assert time.monotonic() < deadline, "the step never started writing"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    (project / "hold").unlink()

    store = Store(project / "store")
    engine = Engine(store, root=project)
    step = Step(
        name="greet",
        recipe="greet",
        version=1,
        doc="",
        action=lambda run: None,
        params={"greeting": "hello"},
        inputs={"name": Path("name.txt")},
    )
    key = engine.key(step)
    assert not store.has(key)
    assert not store.step_dir(key).exists()
    assert list((store.root / "tmp").iterdir()), "the killed run's partial output should be in tmp"

    assert doit(project, env, "greet").returncode == 0
    assert store.has(key)
    assert (store.output_dir(key) / "greeting.txt").read_text() == "hello world"
    assert not list((store.root / "tmp").iterdir()), "leftovers of the killed run are cleaned"


def test_key_is_the_same_for_the_same_material_in_any_order():
    a = key_material("r", 1, {"x": 1, "y": [1, 2]}, {"f": "0" * 64}, {"d": "1" * 64})
    b = key_material("r", 1, {"y": [1, 2], "x": 1}, {"f": "0" * 64}, {"d": "1" * 64})
    assert step_key(a) == step_key(b)
    assert step_key(a) != step_key({**a, "version": 2})


def test_an_unchanged_big_file_is_keyed_again_without_reading_it(tmp_path):
    # 512 MiB: the second keying must read under 1 MiB of it, a ratio a multi-GiB shard only
    # widens (tests/perf/keying.py keys the 460 GB shape), at a quarter of the fast lane's time.
    size = 512 << 20
    big = tmp_path / "shard.safetensors"
    with big.open("wb") as f:
        f.truncate(size)
    first = read_chars()
    digest = StatCache(tmp_path / "cache.sqlite3").digest_file(big)
    assert read_chars() - first >= size

    before = read_chars()
    again = StatCache(tmp_path / "cache.sqlite3").digest_file(big)  # a new process's view
    assert again == digest
    assert read_chars() - before < 1 << 20


def test_content_swapped_under_same_size_and_mtime_is_noticed_through_ctime(tmp_path):
    path = tmp_path / "config.json"
    path.write_bytes(b'{"heads": 64}')
    cache = StatCache(tmp_path / "cache.sqlite3")
    old = cache.digest_file(path)
    st = os.stat(path)
    path.write_bytes(b'{"heads": 72}')
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(path).st_mtime_ns == st.st_mtime_ns
    assert os.stat(path).st_size == st.st_size
    assert StatCache(tmp_path / "cache.sqlite3").digest_file(path) != old


def test_folder_digest_changes_with_content_names_and_executable_bit(tmp_path):
    tree = tmp_path / "ctx"
    (tree / "sub").mkdir(parents=True)
    (tree / "sub" / "a.txt").write_text("a")
    cache = StatCache(tmp_path / "cache.sqlite3")
    digests = [cache.digest_tree(tree)]
    (tree / "sub" / "a.txt").chmod(0o755)
    digests.append(cache.digest_tree(tree))
    (tree / "sub" / "a.txt").rename(tree / "sub" / "b.txt")
    digests.append(cache.digest_tree(tree))
    assert len(set(digests)) == 3


# --- a chain of steps: a dependency, pins, callable params, an Input, a cache of its own ------

DODO_CHAIN = textwrap.dedent(
    """
    import hashlib, json, os
    from pathlib import Path
    from pipelines.core.errors import PipelineError
    from pipelines.engine.steps import Engine, Step, side_task
    from pipelines.engine.store import Store

    HERE = Path(__file__).parent
    DOIT_CONFIG = {"dep_file": os.environ["SPARKFORGE_STORE"] + "/doit.sqlite3"}
    ENGINE = Engine(Store(Path(os.environ["SPARKFORGE_STORE"])), root=HERE)


    class Shelf:
        '''A cache backend outside the store, as the registry is for images: shelf/KEY/.'''

        name = "shelf"

        def has(self, key):
            return (HERE / "shelf" / key / "done").exists()

        def publish(self, key, work, record):
            (HERE / "shelf").mkdir(exist_ok=True)
            os.rename(work / "out", HERE / "shelf" / key)
            (HERE / "shelf" / key / "done").write_text(record["key"])


    class Lines:
        '''An input that digests itself: the non-blank lines of lines.txt.'''

        def digest(self, statcache):
            text = (HERE / "lines.txt").read_text()
            kept = [line for line in text.splitlines() if line.strip()]
            listing = {"lines.txt": statcache.digest_file(HERE / "lines.txt")}
            return hashlib.sha256("\\n".join(kept).encode()).hexdigest(), listing


    def words(run):
        sep = run.params["sep"]
        if sep == "!":
            raise PipelineError("words: '!' is no separator")
        found = [line for line in (HERE / "lines.txt").read_text().splitlines() if line.strip()]
        found.append((HERE / "extra.txt").read_text().strip())
        found += [p.read_text().strip() for p in sorted((HERE / "more").iterdir())]
        (run.out / "words.txt").write_text(sep.join(found))


    def shout(run):
        text = (run.dep("words") / "words.txt").read_text()
        if run.params["case"] == "upper":
            text = text.upper()
        (run.out / "shout.txt").write_text(f"{text} key={run.key}")


    WORDS = Step(
        name="words", recipe="words", version=1, doc="join the words", action=words,
        params=lambda: {"sep": (HERE / "sep.txt").read_text()},
        inputs={"lines": Lines(), "extra": Path("extra.txt"), "more": Path("more")},
    )
    SHOUT = Step(
        name="shout", recipe="shout", version=1, doc="shout the words", action=shout,
        params={"case": "upper"}, deps=(WORDS,), cache=Shelf(),
        pins=lambda: {"base": (HERE / "base.txt").read_text().strip()},
    )


    def task_words():
        return ENGINE.task(WORDS)


    def task_shout():
        return ENGINE.task(SHOUT)


    def announce():
        with (HERE / "announced.log").open("a") as f:
            f.write("announced\\n")


    def task_announce():
        return side_task("announce", "tell the board once", announce,
                         uptodate=lambda: (HERE / "announced.log").exists(), deps=["shout"])


    def post():
        mode = (HERE / "post.txt").read_text().strip()
        if mode == "closed":
            raise PipelineError("post: the board is closed")
        (HERE / "no-such-board").read_text()


    def task_post():
        return side_task("post", "post to the board", post)


    def label(key):
        (HERE / "label.txt").write_text(key)


    def task_label():
        return {"actions": [label], "getargs": {"key": ("words", "key")}, "verbosity": 2}
    """
)
BASE = "sha256:" + "a" * 64


def make_chain(tmp_path: Path) -> tuple[Path, dict]:
    """A project with the two-step chain and its inputs, and the env pointing at its store."""
    project, env = make_project(tmp_path)
    (project / "dodo.py").write_text(DODO_CHAIN)
    (project / "lines.txt").write_text("hello\n\nworld\n")
    (project / "extra.txt").write_text("again\n")
    (project / "more").mkdir()
    (project / "more" / "a.txt").write_text("and\n")
    (project / "more" / "b.txt").write_text("more\n")
    (project / "sep.txt").write_text("-")
    (project / "base.txt").write_text(BASE)
    return project, env


BUILT = re.compile(r"^(\w+): (built|found) ([0-9a-f]{16})( in shelf)? \((\d+\.\d\d) s\)$", re.M)


def reports(stdout: str) -> dict[str, tuple[str, str, str]]:
    """Step name -> (built or found, key prefix, where) from the engine's lines; times sane."""
    found = {}
    for name, state, key, where, took in BUILT.findall(stdout):
        assert float(took) < 60, stdout
        found[name] = (state, key, where.strip())
    return found


def test_a_step_reads_its_dependencys_output_and_lives_in_its_own_cache(tmp_path):
    project, env = make_chain(tmp_path)
    first = doit(project, env, "shout")
    assert first.returncode == 0, first.stderr
    lines = reports(first.stdout)
    assert lines["words"][:1] == ("built",) and lines["words"][2] == ""
    assert lines["shout"][0] == "built" and lines["shout"][2] == "in shelf"
    [shelved] = (project / "shelf").iterdir()
    assert shelved.name.startswith(lines["shout"][1])
    assert (shelved / "shout.txt").read_text() == f"HELLO-WORLD-AGAIN-AND-MORE key={shelved.name}"
    store = Store(project / "store")
    assert not store.step_dir(shelved.name).exists()  # the shelf holds it, not the store
    [words_key] = [p.name for p in (store.root / "steps").iterdir()]
    assert words_key.startswith(lines["words"][1])
    record = json.loads((store.step_dir(words_key) / "step.json").read_text())
    assert record["key"] == words_key and record["name"] == "words"
    assert record["started"] <= record["finished"]
    assert store.has_record("shout", shelved.name) and store.has_record("words", words_key)

    records = {p: p.stat().st_ino for p in (store.root / "records").rglob("*.json")}
    again = doit(project, env, "shout")
    assert again.returncode == 0 and reports(again.stdout) == {}
    assert "-- words" in again.stdout and "-- shout" in again.stdout
    # A no-op run writes nothing: the records of found output are not written again.
    assert {p: p.stat().st_ino for p in (store.root / "records").rglob("*.json")} == records


def test_output_found_in_the_cache_is_recorded_so_explain_names_what_changed_since(tmp_path):
    project, env = make_chain(tmp_path)
    assert doit(project, env, "shout").returncode == 0
    [shelved] = (project / "shelf").iterdir()
    # Another runner, with a store of its own, finds shout in the shelf: nothing to build.
    other = {**env, "SPARKFORGE_STORE": str(tmp_path / "other-store")}
    found = doit(project, other, "shout")
    assert found.returncode == 0, found.stderr
    assert "shout" not in reports(found.stdout) and "-- shout" in found.stdout
    assert Store(tmp_path / "other-store").has_record("shout", shelved.name)
    [built] = Store(project / "store").records_for("shout")
    [kept] = Store(tmp_path / "other-store").records_for("shout")
    times = ("started", "finished")
    assert {k: v for k, v in kept.items() if k not in times} == {
        k: v for k, v in built.items() if k not in times
    }
    assert built["finished"] <= kept["started"] == kept["finished"] <= time.time()

    (project / "base.txt").write_text("sha256:" + "b" * 64)
    explained = doit(project, other, "explain", "shout").stdout
    assert f"against the newest stored output ({shelved.name[:16]})" in explained
    assert "  deps.base: 'sha256:aaaaaaaaa" in explained
    assert "-> 'sha256:bbbbbbbbb" in explained


def test_explain_follows_a_changed_dependency_down_to_the_file_that_changed(tmp_path):
    project, env = make_chain(tmp_path)
    assert doit(project, env, "shout").returncode == 0
    (project / "more" / "b.txt").write_text("less\n")
    (project / "sep.txt").write_text("+")
    lines = doit(project, env, "explain", "shout").stdout.splitlines()
    assert lines[0].startswith("shout: would run: key ")
    assert lines[1].startswith("  deps.words: ")
    assert lines[2].startswith("    words: would run: key ")
    assert lines[3] == "      params.sep: '-' -> '+'"
    assert lines[4].startswith("      inputs.more: ") and lines[4].endswith(" (changed: b.txt)")
    assert len(lines) == 5

    assert doit(project, env, "shout").returncode == 0
    shouted = {p.name: (p / "shout.txt").read_text() for p in (project / "shelf").iterdir()}
    assert sorted(t.split(" key=")[0] for t in shouted.values()) == [
        "HELLO+WORLD+AGAIN+AND+LESS",
        "HELLO-WORLD-AGAIN-AND-MORE",
    ]


def test_every_input_kind_is_part_of_the_key(tmp_path):
    project, env = make_chain(tmp_path)
    assert doit(project, env, "words").returncode == 0
    for path, text in (
        ("lines.txt", "hello\n\nthere\n"),  # the Input object
        ("extra.txt", "too\n"),  # a file after it
        ("more/a.txt", "or\n"),  # a folder
    ):
        (project / path).write_text(text)
        result = doit(project, env, "words")
        assert reports(result.stdout)["words"][0] == "built", (path, result.stdout)
    (project / "lines.txt").write_text("hello\n\n\nthere\n")  # a blank line the Input ignores
    assert "-- words" in doit(project, env, "words").stdout


def failure(result: subprocess.CompletedProcess) -> list[str]:
    """The lines doit printed for a failed task (no traceback: the engine's one line)."""
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "Traceback" not in output, output
    return output.splitlines()


def test_a_missing_input_and_a_failing_action_are_one_line_and_store_nothing(tmp_path):
    project, env = make_chain(tmp_path)
    extra = project / "extra.txt"
    extra.unlink()
    missing = doit(project, env, "words")
    assert f"step words: input 'extra' not found: {extra}" in failure(missing)

    extra.write_text("again\n")
    (project / "sep.txt").write_text("!")
    failed = doit(project, env, "words")
    assert "words: '!' is no separator" in failure(failed)
    assert not list((project / "store" / "steps").iterdir())


def test_a_side_task_runs_until_its_place_says_done_and_fails_in_one_line(tmp_path):
    project, env = make_chain(tmp_path)
    for _ in range(2):
        assert doit(project, env, "announce").returncode == 0
    assert (project / "announced.log").read_text() == "announced\n"

    (project / "post.txt").write_text("closed\n")
    closed = doit(project, env, "post")
    assert "post: the board is closed" in failure(closed)
    (project / "post.txt").write_text("open\n")
    missing = doit(project, env, "post")
    assert (
        f"FileNotFoundError: [Errno 2] No such file or directory: '{project / 'no-such-board'}'"
        in failure(missing)
    )


def waits_for_flock(path: Path) -> bool:
    """Whether some process is blocked on an flock of path (a "->" line of /proc/locks)."""
    inode = f":{path.stat().st_ino} "
    return any("->" in line and inode in line for line in open("/proc/locks"))


def test_a_second_builder_of_a_key_waits_and_uses_the_first_ones_output(tmp_path):
    project, env = make_project(tmp_path)
    (project / "hold").touch()  # the first builder stays mid-write until the second queues

    def greet() -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "doit", "greet"],
            cwd=project,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    first = greet()
    deadline = time.monotonic() + 60
    while not (project / "writing").exists():
        assert first.poll() is None, first.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.02)
    [lock] = (project / "store" / "locks").iterdir()
    second = greet()  # the same key, while the first still writes
    while not waits_for_flock(lock):
        assert second.poll() is None, second.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.02)
    (project / "hold").unlink()
    out, _ = first.communicate()
    second_out, second_err = second.communicate()
    assert first.returncode == 0 and second.returncode == 0, second_err
    assert reports(out)["greet"][0] == "built"
    assert reports(second_out)["greet"][0] == "found"
    assert reports(second_out)["greet"][1] == reports(out)["greet"][1]
    assert runs(project) == ["hello"]  # the action ran once


# --- the store's own API: areas, records -----------------------------------------------------


def test_store_areas_are_plain_names_made_on_first_use(tmp_path):
    store = Store(tmp_path / "store")
    layers = store.area("layers")
    assert layers == tmp_path / "store" / "layers" and layers.is_dir()
    assert store.area("layers") == layers  # a second use finds it
    for name in ("steps", "tmp", "locks", "records", "a/b", ".hidden"):
        with pytest.raises(ValueError) as err:
            store.area(name)
        assert str(err.value) == f"store area {name!r}: reserved or not a plain name"


def test_records_of_a_step_come_newest_first_whatever_its_name(tmp_path):
    store = Store(tmp_path / "store")
    name = "images/base"  # task names may hold a slash: one folder per name all the same
    for key, finished in (("k1", 1.0), ("k2", 3.0), ("k3", 2.0)):
        store.remember({"name": name, "key": key, "finished": finished})
    assert [r["key"] for r in store.records_for(name)] == ["k2", "k3", "k1"]
    assert store.has_record(name, "k1") and not store.has_record(name, "k4")
    assert not store.has_record("images", "k1") and store.records_for("images") == []
    assert [p.name for p in (store.root / "records").iterdir()] == ["images%2Fbase"]


def test_engine_run_builds_once_then_finds_and_passes_its_key_and_params(tmp_path, capsys):
    (tmp_path / "in.txt").write_text("x")
    seen = []
    step = Step(
        name="copy",
        recipe="copy",
        version=1,
        doc="",
        action=lambda run: seen.append((run.key, dict(run.params), run.out)),
        params={"n": 1},
        inputs={"in": Path("in.txt")},
    )
    engine = Engine(Store(tmp_path / "store"), root=tmp_path)
    out = engine.run(step)
    again = engine.run(step)
    key = engine.key(step)
    assert out == again == engine.output(step) == engine.store.output_dir(key)
    assert seen == [(key, {"n": 1}, engine.store.root / "tmp" / seen[0][2].parent.name / "out")]
    printed = capsys.readouterr().out
    assert [(s, k) for s, k, _ in reports(printed).values()] == [("found", key[:16])]
    assert re.search(rf"^copy: built {key[:16]} \(\d+\.\d\d s\)$", printed, re.M)


# --- keys and the stat cache: fixed values, what is recorded --------------------------------


# sha256 of the canonical JSON {"deps":{"d":"1…"},"inputs":{"f":"0…"},"params":{"x":"é"},
# "recipe":"r","version":1}: a key must not move between machines or releases (it names
# outputs in the store and in the registry).
KNOWN_KEY = "6e67a4f3cc466b0e3843e65ba93fafc8ddad6c67eb0d6c8e962765dc52c43dab"
# sha256 of the canonical JSON of the sorted [path, kind (f, x, link), digest or target] list.
KNOWN_TREE = "e36bef8c2bfc3d2e5b9018d0424c984be89e05698af5112b4747d35b7203af17"


def test_keys_are_fixed_values_of_their_material():
    assert canonical_json({"b": [1, 2.5], "a": "é"}) == '{"a":"é","b":[1,2.5]}'.encode()
    with pytest.raises(ValueError):
        canonical_json({"x": float("nan")})
    material = key_material("r", 1, {"x": "é"}, {"f": "0" * 64}, {"d": "1" * 64})
    assert step_key(material) == KNOWN_KEY


def make_tree(root: Path) -> None:
    """A folder with a subfolder, an executable, a world-writable file, a link, and a skip."""
    (root / "sub").mkdir(parents=True)
    (root / "skipdir").mkdir()
    (root / "a.txt").write_text("a")
    (root / "run.sh").write_text("#!/bin/sh\n")
    (root / "run.sh").chmod(0o755)
    (root / "shared.txt").write_text("s")
    (root / "shared.txt").chmod(0o666)
    (root / "sub" / "b.txt").write_text("b")
    (root / "link").symlink_to("sub/b.txt")
    (root / "skipdir" / "c.txt").write_text("c")
    (root / "0-skip.txt").write_text("skip")


def test_a_folder_digest_is_a_fixed_value_of_names_kinds_links_and_contents(tmp_path):
    tree = tmp_path / "tree"
    make_tree(tree)
    cache = StatCache(tmp_path / "cache.sqlite3")
    digest, listing = cache.tree_listing(tree, exclude=["0-skip.txt", "skipdir"])
    sha = {text: hashlib.sha256(text.encode()).hexdigest() for text in ("a", "s", "b")}
    assert listing == {
        "a.txt": sha["a"],
        "link": "sub/b.txt",
        "run.sh": hashlib.sha256(b"#!/bin/sh\n").hexdigest(),
        "shared.txt": sha["s"],
        "sub/b.txt": sha["b"],
    }
    assert digest == KNOWN_TREE
    assert cache.digest_tree(tree, exclude=["0-skip.txt", "skipdir"]) == digest
    assert cache.digest_tree(tree) != digest


def test_a_hard_link_is_found_under_the_name_that_was_hashed(tmp_path):
    cache = StatCache(tmp_path / "deep" / "er" / "cache.sqlite3")  # makes its folders
    blob = tmp_path / "blob"
    blob.write_text("weights")
    other = tmp_path / "other"
    other.write_text("other")
    cache.digest_file(blob)
    os.link(blob, tmp_path / "staged")
    assert cache.path_of_inode(os.stat(tmp_path / "staged")) == blob
    assert cache.path_of_inode(os.stat(other)) is None


def test_only_files_unchanged_since_hashing_are_recorded(tmp_path):
    cache = StatCache(tmp_path / "cache.sqlite3")
    gone, moved, kept = (tmp_path / n for n in ("gone", "moved", "kept"))
    for path in (gone, moved, kept):
        path.write_text(path.name)
    keys = {path: stat_key(os.stat(path)) for path in (gone, moved, kept)}
    gone.unlink()
    moved.write_text("moved on")
    cache.record((path, keys[path], "0" * 64) for path in (gone, moved, kept))
    assert cache.lookup(kept, os.stat(kept)) == "0" * 64
    assert cache.lookup(moved, os.stat(moved)) is None


def test_a_fresh_digest_reads_the_file_again_and_a_folder_is_refused(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"z" * (4 << 20))
    cache = StatCache(tmp_path / "cache.sqlite3")
    cache.digest_file(path)
    before = read_chars()
    cache.digest_files([path])
    assert read_chars() - before < 1 << 20
    cache.digest_files([path], fresh=True)
    assert read_chars() - before >= 4 << 20
    with pytest.raises(IsADirectoryError, match=f"^{tmp_path}: expected a regular file$"):
        cache.digest_files([tmp_path])


def test_a_task_takes_a_steps_key_from_doit(tmp_path):
    project, env = make_chain(tmp_path)
    for _ in range(2):  # built, then up to date: the key comes from doit's saved values
        assert doit(project, env, "label").returncode == 0
    [words_key] = [p.name for p in (project / "store" / "steps").iterdir()]
    assert (project / "label.txt").read_text() == words_key


def test_a_steps_recipe_and_version_are_part_of_its_key(tmp_path):
    (tmp_path / "in.txt").write_text("x")

    def key_of(recipe: str, version: int) -> str:
        step = Step(
            name="copy",
            recipe=recipe,
            version=version,
            doc="",
            action=lambda run: None,
            inputs={"in": Path("in.txt")},
        )
        return Engine(Store(tmp_path / "store"), root=tmp_path).key(step)

    digest = hashlib.sha256(b"x").hexdigest()
    assert key_of("copy", 1) == step_key(key_material("copy", 1, {}, {"in": digest}, {}))
    assert len({key_of("copy", 1), key_of("copy", 2), key_of("move", 1)}) == 3


def test_builders_of_different_keys_do_not_wait_for_each_other(tmp_path):
    store = Store(tmp_path / "store")
    first_inside, second_done = threading.Event(), threading.Event()
    outcome = {}

    def slow(out: Path) -> None:
        first_inside.set()
        # Returns only once the other key was built meanwhile (a shared lock never lets it).
        outcome["waited"] = second_done.wait(timeout=30)

    first = threading.Thread(target=lambda: store.build("k1", {"name": "a"}, slow))
    first.start()
    assert first_inside.wait(timeout=30)
    _, built = store.build("k2", {"name": "b"}, lambda out: second_done.set())
    first.join()
    assert built and outcome == {"waited": True}
    assert store.has("k1") and store.has("k2")


def test_a_cold_digest_hashes_the_biggest_file_first(tmp_path, monkeypatch):
    # Names, sizes and mtimes in three different orders: only size decides.
    for name, size, mtime in (("a.bin", 2, 3000), ("b.bin", 3, 1000), ("c.bin", 1, 2000)):
        path = tmp_path / name
        path.write_bytes(name.encode() * (size << 10))
        os.utime(path, (mtime, mtime))
    hashed = []
    real = statcache.hash_file

    def hash_file(path: Path) -> str:
        hashed.append(path.name)
        return real(path)

    monkeypatch.setattr(statcache, "hash_file", hash_file)
    cache = StatCache(tmp_path / "cache.sqlite3")
    paths = [tmp_path / n for n in ("a.bin", "b.bin", "c.bin")]
    digests = cache.digest_files(paths, workers=1)
    assert hashed == ["b.bin", "a.bin", "c.bin"]
    assert digests == {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in paths}


def test_a_cold_digest_hashes_files_on_every_core(tmp_path, monkeypatch):
    if (os.cpu_count() or 1) < 2:
        pytest.skip("one core: nothing to hash in parallel")
    both = threading.Barrier(2, timeout=10)
    real = statcache.hash_file

    def hash_file(path: Path) -> str:
        both.wait()  # until the other file's hash has started too (one worker: never)
        return real(path)

    monkeypatch.setattr(statcache, "hash_file", hash_file)
    paths = [tmp_path / "one", tmp_path / "two"]
    for path in paths:
        path.write_text(path.name)
    digests = StatCache(tmp_path / "cache.sqlite3").digest_files(paths)
    assert digests == {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in paths}


def test_a_stat_cache_write_waits_for_another_writer_to_finish(tmp_path):
    """doit's parallel workers share the stat cache: a writer waits (up to 60 s), it does not
    fail with "database is locked" after sqlite's default 5 s."""
    cache = StatCache(tmp_path / "cache.sqlite3")
    path = tmp_path / "f"
    path.write_text("f")
    db = tmp_path / "cache.sqlite3"
    other = sqlite3.connect(db, isolation_level=None, check_same_thread=False)
    other.execute("BEGIN EXCLUSIVE")
    release = threading.Timer(6, other.execute, ["COMMIT"])
    release.start()
    try:
        assert cache.digest_file(path) == hashlib.sha256(b"f").hexdigest()
    finally:
        release.join()
        other.close()
    assert cache.lookup(path.absolute(), os.stat(path)) == hashlib.sha256(b"f").hexdigest()


# --- outputs are checked, as a Nix store's are -------------------------------------------------


def stored_greeting(store: Path) -> Path:
    """The one stored output file of the greet step."""
    (found,) = store.glob("steps/*/out/greeting.txt")
    return found


def test_an_output_edited_by_hand_is_named_and_made_again(tmp_path):
    project, env = make_project(tmp_path)
    assert run_doit("greet", cwd=project, env=env).returncode == 0
    output = stored_greeting(project / "store")
    assert output.stat().st_mode & 0o222 == 0  # published read-only
    verified = run_doit("verify", cwd=project, env=env)
    assert (verified.returncode, verified.stdout) == (
        0,
        "verify: 1 stored output(s), every file as made\n",
    )
    output.chmod(0o644)
    output.write_text("hello evil")  # same key, other bytes: a no-op run must not take it
    key = output.parent.parent.name
    verified = run_doit("verify", cwd=project, env=env)
    assert verified.returncode == 1
    assert f"verify: greet {key[:16]}: out/greeting.txt: changed\n" in verified.stdout
    rebuilt = run_doit("greet", cwd=project, env=env)
    assert rebuilt.returncode == 0, rebuilt.stderr
    assert (
        f"greet: stored output {key[:16]} differs from its record: out/greeting.txt: changed;"
        " making it again"
    ) in rebuilt.stdout
    assert stored_greeting(project / "store").read_text() == "hello world"
    assert (project / "runs.log").read_text() == "hello\nhello\n"  # made again, once
    again = run_doit("greet", cwd=project, env=env)  # intact again: a no-op
    assert again.returncode == 0 and "differs" not in again.stdout
    assert (project / "runs.log").read_text() == "hello\nhello\n"


@pytest.mark.parametrize("damage", ["removed", "added", "fifo"])
def test_an_output_removed_added_to_or_replaced_by_a_fifo_is_named(tmp_path, damage):
    store = Store(tmp_path / "store")
    engine = Engine(store, root=tmp_path)
    step = Step(
        name="two", recipe="two", version=1, doc="two files",
        action=lambda run: [(run.out / n).write_text(n) for n in ("a", "b")],
    )  # fmt: skip
    out = engine.run(step)
    key = engine.key(step)
    if damage == "removed":
        (out / "a").unlink()
    elif damage == "added":
        (out / "c").write_text("c")
    else:
        (out / "b").unlink()
        os.mkfifo(out / "b")
    said = {
        "removed": ["out/a: missing"],
        "added": ["out/c: added"],
        "fifo": [f"out: cannot be read ({out / 'b'}: expected a regular file)"],
    }[damage]
    assert store.changed(key) == said
    assert not engine.is_done(step)  # set aside: made again by the next run
    assert not store.has(key) and engine.run(step) and store.changed(key) == []


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB filesystem of the test's own (tmpfs), and a way to fill it to the last byte."""
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)], check=True)

    def fill() -> Path:
        filler = disk / "filler"
        with open(filler, "wb", buffering=0) as f, contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * 4096)
        return filler

    yield disk, fill
    subprocess.run(["umount", "-l", str(disk)], check=True)


def test_a_full_disk_is_one_line_and_the_next_run_with_space_builds(small_disk):
    disk, fill = small_disk
    env = {**os.environ, "SPARKFORGE_STORE": str(disk / "store")}
    render = ("render", "profile=tp4-ring", f"image_digest=sha256:{'0' * 64}")
    assert run_doit("list", env=env).returncode == 0  # the store made, then the disk filled:
    filler = fill()
    for args in (("list",), render, ("verify",)):
        full = run_doit(*args, env=env)
        assert (full.returncode, full.stdout) == (1, ""), full.stderr
        assert full.stderr == (
            f"error: {disk / 'store' / 'statcache.sqlite3'}: cannot open the stat cache: disk I/O"
            " error (the disk is full: 0 bytes free)\n"
        )
    filler.unlink()
    again = run_doit(*render, env=env)
    assert again.returncode == 0, again.stdout + again.stderr
    assert run_doit("verify", env=env).stdout.endswith("every file as made\n")


@pytest.mark.timeout(30)  # a FIFO read the old way never returned
@pytest.mark.parametrize("damage", ["fifo", "dev-zero"])
def test_a_step_whose_record_is_no_file_is_set_aside_and_made_again(tmp_path, damage, capsys):
    store = Store(tmp_path / "store")
    engine = Engine(store, root=tmp_path)
    step = Step(
        name="one", recipe="one", version=1, doc="one file",
        action=lambda run: (run.out / "a").write_text("a"),
    )  # fmt: skip
    engine.run(step)
    record = store.step_dir(engine.key(step)) / "step.json"
    record.unlink()
    os.mkfifo(record) if damage == "fifo" else record.symlink_to("/dev/zero")
    assert not engine.is_done(step)
    out = engine.run(step)  # not "Directory not empty": the damaged folder goes first
    assert (out / "a").read_text() == "a" and store.changed(engine.key(step)) == []
    assert f"store: {record.parent}: no readable step.json; set aside, made again" in (
        capsys.readouterr().out
    )
