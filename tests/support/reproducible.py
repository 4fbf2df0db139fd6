"""Two clean builds of one image under other conditions, and the digests recorded where the
project is developed (tests/data/images/digests.yaml): the reproducibility tests' shared part."""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

import pytest
import yaml
from support.image_diff import image_differences
from support.variations import PLAIN, Variation, listed_in_another_order, missing_tools

REPO = Path(__file__).resolve().parent.parent.parent
RECORD = REPO / "tests" / "data" / "images" / "digests.yaml"
CLEAN_BUILD = Path(__file__).resolve().parent / "clean_build.py"


@dataclass(frozen=True)
class Build:
    """One clean build's key, digest and the folder its image.json is in."""

    key: str
    digest: str
    folder: Path


class Builds(Protocol):
    """clean_build of (kind, image) under a variation, made once per session."""

    def __call__(self, kind: str, image: str, variation: Variation = PLAIN) -> Build: ...


def clean_build(
    kind: str, image: str, platform: str, variation: Variation, work: Path, debs: Path
) -> Build:
    """A clean build of an image's base (kind base) or of the image (kind image) under a
    variation, in a process of its own."""
    absent = missing_tools()
    assert not absent, f"the build variations need {', '.join(absent)}: run scripts/install"
    out = Path(tempfile.mkdtemp(dir=work, prefix=f"{kind}-{image}-{variation.name}-"))
    images = REPO / "images"  # all of it: an image may share another's base (base: same_as)
    with contextlib.ExitStack() as stack:
        if variation.shuffled:
            images = stack.enter_context(listed_in_another_order(images, out / "shuffled"))
        folder = images / image
        argv = [sys.executable, str(CLEAN_BUILD), kind, str(folder), platform, str(out / "b")]
        argv.append(str(debs))
        result = subprocess.run(
            variation.command(argv),
            env=variation.environment(dict(os.environ)),
            capture_output=True,
            text=True,
            timeout=1200,
        )
    assert result.returncode == 0, (
        f"{kind} {image} {platform} under {variation.describe()}: exit {result.returncode}:"
        f" {result.stderr.strip()[-1500:]}"
    )
    built = json.loads(result.stdout.strip().splitlines()[-1])
    return Build(built["key"], built["digest"], Path(built["folder"]))


def assert_one_digest(first: Build, second: Build, what: str, variation: Variation) -> None:
    """Both builds have one key and one digest; else the failure names what differs."""
    assert first.key == second.key, f"{what}: the key moved under {variation.describe()}"
    if first.digest != second.digest:
        differences = "\n".join(image_differences(first.folder, second.folder))
        pytest.fail(
            f"{what} under {variation.describe()}: {first.digest} != {second.digest};"
            f" what differs:\n{differences}",
            pytrace=False,
        )


def assert_reproduces_record(
    kind: str, image: str, arch: str, variation: Variation, builds: Builds
) -> None:
    """A clean build of (kind, image) under variation gives the digest recorded for its key
    where the project is developed (a plain build's, another day, another machine): two builds
    under other conditions, one of them recorded. Only where that fails is a plain build made
    here, to tell a build the variation changes (what differs, file and field) from a key not
    recorded yet (the entry to record) or a record this machine does not reproduce."""
    varied = builds(kind, image, variation)
    name = f"{image}-base" if kind == "base" else image
    recorded = (yaml.safe_load(RECORD.read_text()) or {}).get(name, {}).get(arch)
    if recorded and [recorded["key"], recorded["digest"]] == [varied.key, varied.digest]:
        return
    plain = builds(kind, image, PLAIN)
    assert_one_digest(plain, varied, f"{kind} {image} {arch}", variation)
    where = RECORD.relative_to(REPO)
    if recorded is None or recorded["key"] != plain.key:
        entry = {
            "key": plain.key,
            "digest": plain.digest,
            "measured": datetime.date.today().isoformat(),
            "variations": [variation.describe()],
        }
        record = yaml.safe_dump({name: {arch: entry}}, sort_keys=False, width=200)
        pytest.fail(
            f"{where}: no digest recorded for {name} {arch} key {plain.key}; a plain build and"
            f" one under other conditions agreed here; where the project is developed, record:\n"
            + record,
            pytrace=False,
        )
    pytest.fail(
        f"{name} {arch}: key {plain.key[:16]} gave {plain.digest} here (plain and under"
        f" {variation.describe()}), where {where} records {recorded['digest']}"
        f" ({recorded['measured']})",
        pytrace=False,
    )


def in_registry(
    stack,
    kind: str,
    image: str,
    platform: str,
    tmp_path_factory,
    builds: Builds,
    variation: Variation,
) -> str:
    """The session's clean build of (kind, image) under variation (shared by its workers) in the
    tests' registry under its step's key, pushed by the step's own cache where the registry
    lacks the key (an image's base must be there first); its pinned reference. One build per
    key and architecture in a run, not two: a build the reproducibility tests check anyway."""
    from support.stages import ImageAt

    from pipelines.core.site import Site
    from pipelines.engine.steps import Engine
    from pipelines.engine.store import Store

    site = Site(lambda: (stack.registry, (stack.docker_host,)))
    engine = Engine(Store(tmp_path_factory.mktemp(f"{kind}-store")))
    images = ImageAt(REPO / "images" / image, platform, engine, site)
    step = images.base_step if kind == "base" else images.image_step
    assert step is not None and step.cache is not None
    built = builds(kind, image, variation)
    assert built.key == engine.key(step), f"{kind} {image} {platform}: the step's key moved"
    if not step.cache.has(built.key):
        with tempfile.TemporaryDirectory() as work:
            (Path(work) / "out").symlink_to(built.folder)
            step.cache.publish(built.key, Path(work), {"name": step.name, **engine.material(step)})
    engine.run(step)  # finds its key's tag: builds nothing
    return images.base_ref() if kind == "base" else images.image_ref()


def session_builds(platform: str, tmp_path_factory, debs: Path) -> Builds:
    """clean_build for (kind, image, variation), each made once per session: the first worker
    to ask builds it (under a lock), the others read what it wrote."""
    base = tmp_path_factory.getbasetemp()
    # Under pytest-xdist each worker's basetemp is a folder of the session's own.
    shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "builds"
    shared.mkdir(exist_ok=True)

    def build(kind: str, image: str, variation: Variation = PLAIN) -> Build:
        name = f"{kind}-{image}-{platform.replace('/', '-')}-{variation.name}"
        result = shared / f"{name}.json"
        with (shared / f"{name}.lock").open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another worker building it: wait for its result
            if not result.exists():
                made = clean_build(kind, image, platform, variation, shared, debs)
                result.write_text(json.dumps({**asdict(made), "folder": str(made.folder)}))
            recorded = json.loads(result.read_text())
        return Build(recorded["key"], recorded["digest"], Path(recorded["folder"]))

    return build


def variation_id(value):
    """A variation by its name in test ids."""
    return getattr(value, "name", value)


def fail_without_emulation(arch: str) -> None:
    """Fail in one line where this machine cannot run arch's binaries (never skip)."""
    from pipelines.stages.images.emulation import emulation_problem
    from pipelines.stages.images.inputs import debian_arch

    problem = emulation_problem(arch, debian_arch())
    if problem is not None:
        pytest.fail(f"{arch} under emulation: {problem}; run scripts/install", pytrace=False)
