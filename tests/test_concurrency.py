"""Two of one thing at once on one store: stagers of one model folder take turns (an flock beside
it, temp names of their own), two `doit build` both finish with the same outputs, and a second
`doit deploy` of a profile waits for the first, whose deployment stays intact."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.deploying import member, records, served_models
from support.doit import REPO
from support.signals import default_signals

from pipelines.core.modellock import cache_key, load_lock, lock_path
from pipelines.engine.statcache import StatCache
from pipelines.engine.store import Store
from pipelines.stages.deploy.profilelock import holder, in_turn, profile_lock
from pipelines.stages.weights.blobs import BlobStore
from pipelines.stages.weights.stage import StageError, check_plan, is_staged, stage, temp_name

# A stager in a process of its own: stages folder `m` to the two plans in turn, ROUNDS times.
STAGER = """
import json, sys
from pathlib import Path
from pipelines.engine.statcache import StatCache
from pipelines.stages.weights.blobs import BlobStore
from pipelines.stages.weights.stage import stage
root, plans, rounds = Path(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3])
blobs = BlobStore(root / "weights", StatCache(root / "statcache.sqlite3"))
for i in range(rounds):
    stage(blobs.models / "m", plans[i % 2], blobs)
"""

# A deploy's turn held in a process of its own until a line on stdin; with "helper" it first
# starts a process that outlives it and inherits every descriptor it may (an ssh forward).
HOLDER = """
import subprocess, sys
from pathlib import Path
from pipelines.stages.deploy.profilelock import in_turn
with in_turn(Path(sys.argv[1]), "p", "deploy", "holder"):
    if sys.argv[2] == "helper":
        print(subprocess.Popen(["sleep", "120"], close_fds=False).pid, flush=True)
    print("holding", flush=True)
    sys.stdin.readline()
"""

# A second deploy's turn: says when it has it.
WAITER = """
import sys
from pathlib import Path
from pipelines.stages.deploy.profilelock import in_turn
with in_turn(Path(sys.argv[1]), "p", "deploy", "waiter"):
    print("my turn", flush=True)
"""


def python(script: str, *args: str, stdin: int | None = None) -> subprocess.Popen[str]:
    """`python -c script args` from the checkout (its pipelines first), output piped."""
    return subprocess.Popen(
        [sys.executable, "-c", script, *args],
        cwd=REPO,
        stdin=stdin,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.fixture
def blobs(tmp_path) -> BlobStore:
    """A blob store of the test's own."""
    return BlobStore(tmp_path / "weights", StatCache(tmp_path / "statcache.sqlite3"))


def two_plans(blobs: BlobStore, files: int) -> list[dict[str, str]]:
    """Two plans of the same names, each name another blob in each."""
    shas = [blobs.add_bytes(f"blob {i}".encode()) for i in range(2 * files)]
    return [{f"f{i}": shas[i + files * p] for i in range(files)} for p in (0, 1)]


def test_two_stagers_of_one_folder_take_turns_and_both_finish(tmp_path, blobs):
    plans = two_plans(blobs, 40)
    stagers = [python(STAGER, str(tmp_path), json.dumps(plans), "30") for _ in range(2)]
    outputs = [p.communicate(timeout=120)[0] for p in stagers]
    assert [p.returncode for p in stagers] == [0, 0], outputs
    folder = blobs.models / "m"
    assert is_staged(folder, plans[1], blobs)  # both ended on it
    assert sorted(p.name for p in folder.parent.iterdir()) == ["m", "m.staging.lock"]


def test_a_staging_temp_name_is_a_stagers_own_and_a_killed_ones_is_removed(blobs):
    names = {temp_name() for _ in range(100)}
    assert len(names) == 100
    for name in names:
        assert name.startswith(".") and name.endswith(".staging")
        with pytest.raises(StageError, match="expected a plain file name"):
            check_plan(blobs.models / "m", {name: "0" * 64})
    plan = two_plans(blobs, 3)[0]
    folder = blobs.models / "m"
    folder.mkdir()
    leftover = folder / temp_name()  # a stager killed between link and rename
    os.link(blobs.blob(plan["f0"]), leftover)
    assert not is_staged(folder, plan, blobs)
    assert stage(folder, plan, blobs) == ["f0", "f1", "f2"]
    assert sorted(os.listdir(folder)) == ["f0", "f1", "f2"]


def test_a_second_deploy_of_a_profile_waits_naming_the_first_then_takes_its_turn(tmp_path):
    path = profile_lock(tmp_path, "p")
    first = python(HOLDER, str(path), "", stdin=subprocess.PIPE)
    assert first.stdout.readline() == "holding\n"
    second = python(WAITER, str(path))
    line = second.stdout.readline()
    assert re.fullmatch(
        rf"deploy: waiting for the deploy of profile p held by pid {first.pid}"
        r" \(holder, since \d\d:\d\d:\d\d UTC\) \.\.\.\n",
        line,
    ), line
    time.sleep(0.5)
    assert second.poll() is None  # still waiting
    first.communicate("go\n", timeout=30)
    assert second.communicate(timeout=30)[0] == "my turn\n"
    assert (first.returncode, second.returncode) == (0, 0)


def test_a_killed_deploy_leaves_no_lock_even_where_a_helper_of_it_lives_on(tmp_path):
    path = profile_lock(tmp_path, "p")
    first = python(HOLDER, str(path), "helper", stdin=subprocess.PIPE)
    helper = int(first.stdout.readline())
    try:
        assert first.stdout.readline() == "holding\n"
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
        second = python(WAITER, str(path))
        assert second.communicate(timeout=30)[0] == "my turn\n"  # no wait at all
    finally:
        os.kill(helper, signal.SIGKILL)


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b'{"pid": 12',  # a holder writing it right now
        b"[" * 100_000,
        b'{"pid": "x", "action": "deploy", "who": "a", "since": 0}',
        b'{"pid": 1e999, "action": "deploy", "who": "a", "since": 0}',
        b'{"pid": 7, "action": "deploy", "who": "a", "since": 1e999}',
        b'{"pid": 7, "action": "deploy\\nerror: forged", "who": "a", "since": 0}',
        b'{"pid": 7, "action": "deploy", "who": "a\\nerror: forged", "since": 0}',
        b"\x00\xff" * 3000,
    ],
)
def test_the_waiting_line_is_one_line_whatever_the_lock_file_holds(tmp_path, content: bytes):
    path = profile_lock(tmp_path, "p")
    path.write_bytes(content)
    line = holder(path, "p")
    assert line.startswith("deploy of profile p held by ")
    assert "\n" not in line and "forged" not in line


def test_the_lock_file_says_who_holds_it_only_while_held(tmp_path):
    path = profile_lock(tmp_path, "p")
    with in_turn(path, "p", "rollback", "someone"):
        assert holder(path, "p").startswith(
            f"rollback of profile p held by pid {os.getpid()} (someone, since "
        )
    assert holder(path, "p") == "deploy of profile p held by another process"


# --- on the stack: doit itself, twice at once ---------------------------------------------------


def doit(env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    """`python -m doit ARGS` in the checkout, started now, output piped."""
    return subprocess.Popen(
        [sys.executable, "-m", "doit", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=default_signals,  # a test stops it with SIGINT or SIGTERM
    )


def finished(*runs: subprocess.Popen[str]) -> list[str]:
    """Each run's output, once all have exited."""
    return [run.communicate(timeout=600)[0] for run in runs]


def step_keys(output: str) -> dict[str, str]:
    """Step -> the key a build built, found or restored ('render: built 3eb93cd878cc30c8')."""
    found = re.findall(r"^(\w+): (?:built|found|restored) ([0-9a-f]{16})\b", output, re.M)
    return dict(found)


def lock_waiters(path: Path) -> list[int]:
    """Pids waiting for an flock on path (/proc/locks lists them after '->')."""
    inode = os.stat(path).st_ino
    pids = []
    with open("/proc/locks") as f:
        for line in f:
            fields = line.split()
            if fields[1] == "->" and fields[6].rsplit(":", 1)[1] == str(inode):
                pids.append(int(fields[5]))
    return pids


def wait_for(condition, timeout: float = 120) -> None:
    """Return once condition() holds; fail after timeout seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{condition.__doc__} not within {timeout} s"
        time.sleep(0.05)


def containers(docker_client, profile: str) -> list[tuple[str, str, str]]:
    """(name, id, status) of the profile's containers (other modules' run beside them)."""
    found = docker_client.containers.list(all=True, filters={"name": f"sparkforge-{profile}-"})
    return sorted((c.name, c.id, c.status) for c in found)


def test_two_builds_at_once_on_one_store_both_finish_with_the_same_outputs(stack, tmp_path):
    env = {**os.environ, "SPARKFORGE_STORE": str(tmp_path / "store")}
    runs = [doit(env, "build", "profile=local") for _ in range(2)]
    outputs = finished(*runs)
    assert [run.returncode for run in runs] == [0, 0], outputs
    keys = [step_keys(output) for output in outputs]
    both = set(keys[0]) & set(keys[1])  # a step the other finished first is up to date: no line
    assert {k: keys[0][k] for k in both} == {k: keys[1][k] for k in both}
    store = Store(tmp_path / "store")
    # One output of each step, whoever made it: records/<step>/<key>.json. Normalized layers
    # ("layer", one record per layer of an image built here) are outputs the image step makes,
    # not steps of the graph; where the registry already held the image there are none.
    made = {p.name: [r.stem for r in p.iterdir()] for p in (store.root / "records").iterdir()}
    layers = made.pop("layer", [])
    assert {"profile", "image", "render", "patch_config"} <= set(made)
    assert all(len(made_keys) == 1 for made_keys in made.values()), made
    # Each layer normalized once, by whichever build held the image step's lock.
    normalized = [re.findall(r"^image: .*normalized", out, re.M) for out in outputs]
    assert sum(len(lines) for lines in normalized) <= len(layers), normalized
    lock = load_lock(lock_path("dsv41-flash-synthetic"))
    folder = store.root / "weights" / "models" / cache_key(lock.source)
    staged = sorted(os.listdir(folder))
    assert len(staged) == 55

    # Again, lined up: both wait for the patch step's lock, then stage a folder that takes a
    # while (leftovers of killed stagers to remove), so both are in it at once.
    patch = made["patch_config"][0]
    shutil.rmtree(store.step_dir(patch))
    shutil.rmtree(folder)
    folder.mkdir()
    for i in range(3000):
        (folder / f".{i}.killed.staging").touch()
    with store.lock(patch):
        runs = [doit(env, "build", "profile=local") for _ in range(2)]
        lock_file = store.root / "locks" / f"{patch}.lock"

        def both_wait() -> bool:
            """both builds waiting for the patch step"""
            return sorted(lock_waiters(lock_file)) == sorted(run.pid for run in runs)

        wait_for(both_wait)
    outputs = finished(*runs)
    assert [run.returncode for run in runs] == [0, 0], outputs
    assert sorted(os.listdir(folder)) == staged
    assert [step_keys(output) for output in outputs] == [{"patch_config": patch[:16]}] * 2
    again = finished(doit(env, "build", "profile=local"))[0]
    assert not re.search(r"^\.  ", again, re.M), again  # nothing left to do


def test_two_deploys_at_once_the_second_waits_and_the_first_deployment_is_intact(
    world, docker_client
):
    # The first may be held still while the second starts: give it time to serve after that.
    env = {**world["env"], "SPARKFORGE_DEPLOY_TIMEOUT": "300"}
    name = world["name"]
    path = profile_lock(world["store"] / "deployments", name)
    first = doit(env, "deploy", f"profile={name}")

    def first_holds() -> bool:
        """the first deploy holding the profile's lock"""
        return path.exists() and f"held by pid {first.pid} " in holder(path, name)

    wait_for(first_holds, timeout=300)
    first.send_signal(signal.SIGSTOP)  # mid-deploy, for as long as the second takes to start
    try:
        second = doit(env, "deploy", f"profile={name}")

        def second_waits_or_ended() -> bool:
            """the second deploy waiting for the lock (or ended)"""
            return second.pid in lock_waiters(path) or second.poll() is not None

        wait_for(second_waits_or_ended, timeout=300)
    finally:
        first.send_signal(signal.SIGCONT)
    outputs = finished(first, second)
    assert [first.returncode, second.returncode] == [0, 0], outputs
    assert (
        f"deploy: waiting for the deploy of profile {name} held by pid {first.pid} (" in outputs[1]
    ), outputs[1]
    assert "deploy: deployed " in outputs[0] or "deploy: nothing restarted " in outputs[0]
    assert "deploy: nothing restarted " in outputs[1], outputs[1]

    mine = records(world)[-2:]
    assert [r["outcome"] for r in mine] in (["deployed", "unchanged"], ["unchanged"] * 2)
    assert mine[1]["started"] >= mine[0]["finished"]  # the second began after the first ended
    key = mine[0]["deployment"]["key"]
    assert mine[1]["deployment"]["key"] == key
    container = member(docker_client, name)
    assert container.status == "running"
    assert key in json.dumps(container.labels)
    assert served_models(world) == [world["profile"]["model"]["served_name"]]
    assert holder(path, name) == f"deploy of profile {name} held by another process"


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM])
def test_a_deploy_stopped_while_it_waits_says_so_in_one_line_and_touches_nothing(
    world, docker_client, stop
):
    name = world["name"]
    path = profile_lock(world["store"] / "deployments", name)
    before = (len(records(world)), containers(docker_client, name))
    with in_turn(path, name, "rollback", "the test"):
        waiting = doit(world["env"], "deploy", f"profile={name}")

        def it_waits() -> bool:
            """the deploy waiting for the lock (or ended)"""
            return waiting.pid in lock_waiters(path) or waiting.poll() is not None

        wait_for(it_waits, timeout=300)
        waiting.send_signal(stop)
        output = finished(waiting)[0]
    assert waiting.returncode == 130, output
    assert (
        f"deploy of profile {name}: stopped ({stop.name}) while waiting for the rollback of"
        f" profile {name} held by pid {os.getpid()} (the test, since "
    ) in output
    assert "Traceback" not in output
    after = (len(records(world)), containers(docker_client, name))
    assert after == before
