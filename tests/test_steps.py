"""The keyed step engine: keys, the store, the stat cache and doit's use of them."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from keying import read_chars

from pipelines.keys import key_material, step_key
from pipelines.statcache import StatCache
from pipelines.steps import Engine, Step
from pipelines.store import Store

DODO = textwrap.dedent(
    """
    import os, time
    from pathlib import Path
    from doit import get_var
    from pipelines.steps import Engine, Step
    from pipelines.store import Store

    DOIT_CONFIG = {"dep_file": os.environ["SPARKFORGE_STORE"] + "/doit.sqlite3"}
    ENGINE = Engine(Store(Path(os.environ["SPARKFORGE_STORE"])), root=Path(__file__).parent)
    RUNS = Path(__file__).parent / "runs.log"

    def greet(run):
        with RUNS.open("a") as f:
            f.write(run.step.params["greeting"] + "\\n")
        text = run.step.params["greeting"] + " " + Path("name.txt").read_text()
        out = run.out / "greeting.txt"
        with out.open("w") as f:
            for _ in range(int(get_var("slow", "0"))):
                f.write(text)
                f.flush()
                Path("writing").touch()
                time.sleep(0.05)
            f.write(text)

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
    return subprocess.run(
        [sys.executable, "-m", "doit", *args], cwd=project, env=env, capture_output=True, text=True
    )


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
    proc = subprocess.Popen(
        [sys.executable, "-m", "doit", "greet", "slow=200"],
        cwd=project,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while not (project / "writing").exists():
        assert time.monotonic() < deadline, "the step never started writing"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()

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


def test_unchanged_multi_gib_file_is_keyed_again_without_reading_it(tmp_path):
    big = tmp_path / "shard.safetensors"
    with big.open("wb") as f:
        f.truncate(2 << 30)
    first = read_chars()
    digest = StatCache(tmp_path / "cache.sqlite3").digest_file(big)
    assert read_chars() - first >= 2 << 30

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
