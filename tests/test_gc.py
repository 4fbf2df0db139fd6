"""`doit gc` on a store that has been through builds and deploys of one profile (the local
stack, one member): it keeps what the roots reach, frees the rest, and a deploy and a rollback
still work after it; beside a run that uses the store it waits, breaking neither."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import requests
import yaml
from support.deploying import (
    deploy_variant,
    deployed,
    derived_image,
    doit,
    member,
    records,
    served_models,
    tag_digest,
)

from pipelines.stages.images.registry import ACCEPT

REPO = Path(__file__).resolve().parent.parent
ORPHAN_BLOB = "ab" * 32  # a model blob no staged folder links (written by the test)


def variant(world, ttft_s: float) -> dict:
    """The world's profile with another simulated TTFT: other render and profile keys."""
    profile = copy.deepcopy(world["profile"])
    profile["simulator"]["ttft_s"] = ttft_s
    return profile


def build_variant(world, profile: dict) -> None:
    """`doit build` of a variant of the profile (the world's profile is put back after)."""
    path = world["profiles"] / f"{world['name']}.yaml"
    path.write_text(yaml.safe_dump(profile))
    try:
        result = doit(world, "build")
    finally:
        path.write_text(yaml.safe_dump(world["profile"]))
    assert result.returncode == 0, result.stdout + result.stderr


def render_keys(world) -> list[str]:
    """The render steps' keys in the store, newest record first."""
    folder = world["store"] / "records" / "render"
    found = [json.loads(p.read_text()) for p in folder.glob("*.json")]
    return [r["key"] for r in sorted(found, key=lambda r: r["finished"], reverse=True)]


def bench_run(world, stamp: str, manifests_key: str) -> Path:
    """A bench run's folder as the bench leaves it (results.json with its provenance)."""
    run = world["store"] / "bench" / world["name"] / stamp
    run.mkdir(parents=True)
    results = {"provenance": {"manifests_key": manifests_key}, "decode": {}}
    (run / "results.json").write_text(json.dumps(results))
    (run / "report.md").write_text("report\n" * 100)
    return run


def gc(world, *args: str, **env: str) -> subprocess.CompletedProcess:
    """`doit gc` on the world's store; the output shown for the log."""
    result = doit(world, "gc", *args, SPARKFORGE_GC_KEEP_BUILDS="1", **env)
    print(result.stdout + result.stderr)
    return result


def test_gc_keeps_what_roots_reach_and_a_deploy_and_rollback_work_after(world, docker_client):
    """Five builds of the profile with different inputs (three builds, then deploys of two
    more, the second with another image, then the first again), a bench run per deployment
    and an old one, an orphan blob; one build kept (N=1)."""
    for ttft in (0.33, 0.34, 0.35):
        build_variant(world, variant(world, ttft))
    deployed(world)
    other = derived_image(world, docker_client, "gc-previous")
    old = deploy_variant(world, variant(world, 0.31), f"image_digest={other}")
    assert old.returncode == 0, old.stdout + old.stderr
    deployed(world)  # the world's own profile again: the live deployment
    live, previous = records(world)[-1], records(world)[-2]
    assert live["deployment"]["key"] != previous["deployment"]["key"]
    renders = render_keys(world)
    assert len(renders) == 5
    gone_renders, kept_renders = renders[2:], renders[:2]
    bench_run(world, "20260101T000000Z", previous["deployment"]["key"])
    stale_bench = bench_run(world, "20260101T000001Z", "cd" * 32)
    bench_run(world, "20260101T000002Z", live["deployment"]["key"])
    blobs = world["store"] / "weights" / "blobs" / "sha256"
    (blobs / ORPHAN_BLOB).write_bytes(b"x" * 4096)
    staged = sorted(p.name for p in blobs.iterdir() if p.stat().st_nlink > 1)
    assert staged

    dry = gc(world)

    assert dry.returncode == 0
    out = dry.stdout
    assert "dry run, nothing deleted" in out
    assert f"the live deployment of {world['name']}" in out
    assert f"the previous deployment of {world['name']}" in out
    assert "build 1 of the last 1" in out
    assert "linked by the staged models/" in out
    assert all((world["store"] / "steps" / key).is_dir() for key in renders)
    freeing = [line for line in out.splitlines() if "would free" in line and "steps/" in line]
    would = {line.split("steps/")[1][:16] for line in freeing}
    assert {k[:16] for k in gone_renders} <= would
    assert {k[:16] for k in kept_renders} & would == set()
    assert "total: would free" in out and "total: would free 0 B" not in out
    published = json.loads((world["store"] / "gc" / "roots.json").read_text())["steps"]
    assert set(kept_renders) <= set(published) and not set(gone_renders) & set(published)

    real = gc(world, "--delete")

    assert real.returncode == 0, real.stdout + real.stderr
    assert "total: freed" in real.stdout
    assert [k for k in gone_renders if (world["store"] / "steps" / k).exists()] == []
    assert [k for k in kept_renders if not (world["store"] / "steps" / k).exists()] == []
    assert not (blobs / ORPHAN_BLOB).exists()
    assert [name for name in staged if not (blobs / name).exists()] == []
    assert not stale_bench.exists()
    assert sorted(p.name for p in stale_bench.parent.iterdir()) == [
        "20260101T000000Z",
        "20260101T000002Z",
    ]
    again = gc(world)
    assert "total: would free 0 B" in again.stdout

    # The live deployment again: nothing rebuilt, nothing restarted.
    running = member(docker_client, world["name"]).id
    redeploy = doit(world, "deploy")
    print(redeploy.stdout)
    assert redeploy.returncode == 0, redeploy.stdout + redeploy.stderr
    assert "nothing restarted" in redeploy.stdout
    assert ": built " not in redeploy.stdout
    assert member(docker_client, world["name"]).id == running

    back = doit(world, "rollback")
    print(back.stdout)
    assert back.returncode == 0, back.stdout + back.stderr
    assert records(world)[-1]["outcome"] == "restored"
    assert records(world)[-1]["deployment"]["key"] == previous["deployment"]["key"]
    assert member(docker_client, world["name"]).attrs["Config"]["Image"].endswith(other)
    assert served_models(world) == [world["profile"]["model"]["served_name"]]


HOLDER = """
import sys, time
from pathlib import Path
from pipelines.engine.store import Store
store = Store(Path(sys.argv[1]))
key = sys.argv[2]
assert store.has(key)
print("found", flush=True)
sys.stdin.readline()
print((store.output_dir(key) / "launch-0-localhost.yaml").read_text()[:20], flush=True)
"""


def test_gc_waits_for_a_run_that_found_a_step_it_would_free(world):
    """A run that found a step done reads it later (deploy reads the render it found): gc,
    started in between, waits for it, then frees the step."""
    build_variant(world, variant(world, 0.37))
    key = render_keys(world)[0]
    deployed(world)  # a newer build: the variant's render is no root now (N=1)
    holder = hold_store(world, key)
    try:
        collector = start_doit(world, "gc", "--delete")
        said = said_waiting(collector)  # waiting, not deleting
        assert (world["store"] / "steps" / key).is_dir()
        release(holder)
        rest, _ = collector.communicate(timeout=120)
        out = said + rest
    finally:
        holder.kill()
    print(out)
    assert collector.returncode == 0, out
    assert "gc: waiting for the other runs using" in out
    assert not (world["store"] / "steps" / key).exists()


def hold_store(world, key: str) -> subprocess.Popen:
    """A run that has the store open and found key's step done; it reads it when told."""
    env = {**world["env"], "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(world["store"]), key],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert holder.stdout.readline() == "found\n"
    return holder


def release(holder: subprocess.Popen) -> None:
    """Let a holder read its step and end."""
    holder.stdin.write("go\n")
    holder.stdin.flush()
    assert holder.wait(30) == 0


def said_waiting(process: subprocess.Popen, timeout: float = 300) -> str:
    """What a doit run printed up to its line saying it waits for the other runs using the
    store (it is waiting then, however long it took to start on a loaded machine). Read by a
    thread: a select() on the pipe would miss a line already in the reader's buffer."""
    lines: list[str] = []
    said = threading.Event()

    def read() -> None:
        for line in process.stdout:
            lines.append(line)
            if "waiting for the other runs using" in line:
                break
        said.set()

    threading.Thread(target=read, daemon=True).start()
    assert said.wait(timeout), f"never said it waits (timed out): {lines}"
    assert lines and "waiting for the other runs using" in lines[-1], f"ended: {lines}"
    return "".join(lines)


def start_doit(world, *args: str) -> subprocess.Popen:
    """doit on the world's profile and store, in the background, one build kept (N=1)."""
    return subprocess.Popen(
        [sys.executable, "-m", "doit", *args, f"profile={world['name']}"],
        cwd=REPO,
        env={**world["env"], "SPARKFORGE_GC_KEEP_BUILDS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_gc_beside_a_build_breaks_neither(world):
    """`doit gc --delete` is under way (waiting for a run) when a `doit build` of new inputs
    starts: the build finishes, then gc, and gc keeps the build's outputs (the newest build)."""
    live_render = next(k for k in render_keys(world) if (world["store"] / "steps" / k).is_dir())
    holder = hold_store(world, live_render)
    path = world["profiles"] / f"{world['name']}.yaml"
    try:
        collector = start_doit(world, "gc", "--delete")
        said = said_waiting(collector)  # under way: waiting for the holder
        path.write_text(yaml.safe_dump(variant(world, 0.38)))
        build = start_doit(world, "build")
        built, _ = build.communicate(timeout=600)
        release(holder)
        rest, _ = collector.communicate(timeout=120)
        collected = said + rest
    finally:
        path.write_text(yaml.safe_dump(world["profile"]))
        holder.kill()
    print(built, collected)
    assert build.returncode == 0, built
    assert collector.returncode == 0, collected
    assert "gc: waiting for the other runs using" in collected
    log = sorted((world["store"] / "builds" / world["name"]).glob("*.json"))[-1]
    steps = json.loads(log.read_text())["steps"]
    assert steps["render"] == render_keys(world)[0] != live_render
    stored = [n for n in steps if n not in ("image", "image_base")]
    assert [
        n for n in stored if not (world["store"] / "steps" / steps[n] / "step.json").is_file()
    ] == []
    assert f"build 1 of the last 1 of {world['name']} (render)" in collected


def retag(world, digest: str, tag: str) -> None:
    """Put a manifest already in the test's repository under another tag."""
    base = f"http://{world['registry']}/v2/{world['repository']}/manifests"
    got = requests.get(f"{base}/{digest}", headers={"Accept": ACCEPT}, timeout=10)
    got.raise_for_status()
    put = requests.put(
        f"{base}/{tag}",
        data=got.content,
        headers={"Content-Type": got.headers["Content-Type"]},
        timeout=10,
    )
    put.raise_for_status()


def test_gc_deletes_old_candidate_and_key_tags_on_images_no_root_reaches(world, docker_client):
    """An image only under candidate- and key- tags goes once a gc has seen them D days
    before; the same kind of tag on the live image stays, and so do :stable and the rest."""
    deployed(world)
    live = records(world)[-1]["image"].split("@")[1]
    stray = derived_image(world, docker_client, "candidate-0ld")
    retag(world, stray, "key-" + "0" * 32)
    retag(world, live, "key-" + "f" * 32)
    repo = world["repository"]

    young = gc(world, SPARKFORGE_GC_TAG_DAYS="30")
    assert young.returncode == 0, young.stdout + young.stderr
    assert (
        f"keep       tag    {repo}:candidate-0ld (0 B): tagged candidate-0ld, first seen by gc"
        " 0.0 days ago (< 30)" in young.stdout
    )

    dry = gc(world, SPARKFORGE_GC_TAG_DAYS="0")
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert f"would free tag    {repo}:candidate-0ld" in dry.stdout
    assert f"would free tag    {repo}:key-{'0' * 32}" in dry.stdout
    kept = f"keep       tag    {repo}:key-{'f' * 32} (0 B): the live deployment of {world['name']}"
    assert kept in dry.stdout
    assert tag_digest(world, "candidate-0ld") == stray

    real = gc(world, "--delete", SPARKFORGE_GC_TAG_DAYS="0")

    assert real.returncode == 0, real.stdout + real.stderr
    assert tag_digest(world, "candidate-0ld") is None
    assert tag_digest(world, "key-" + "0" * 32) is None
    assert tag_digest(world, "key-" + "f" * 32) == live
    assert tag_digest(world, "stable") == live
    assert tag_digest(world, "gc-previous") is not None  # not a tag gc collects
    redeploy = doit(world, "deploy")
    assert redeploy.returncode == 0 and "nothing restarted" in redeploy.stdout
