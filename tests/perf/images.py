"""Benchmark: the images step, cache hit and rebuild, against a plain `docker build`.

Run: .venv/bin/python tests/perf/images.py [--runs 3]

Cache hit: wall time of `doit image` when the registry holds the key (target under 1 s;
includes Python start-up and loading the task graph). Rebuild: a copy of images/local-sim
with one changed byte in a COPY'd file (a new key each time, the steps from that COPY on
rerun), built, normalized and pushed by this project, vs a plain `docker build` of the same
folder on the same engine (both may use the engine's cache for the unchanged steps).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "perf"))
sys.path.insert(0, str(REPO / "tests"))

from plot import bar_chart  # noqa: E402
from support.stages import context, image_copy  # noqa: E402

import devstack  # noqa: E402
from pipelines.core.paths import RECEIPT  # noqa: E402
from pipelines.core.profiles import load_profile  # noqa: E402
from pipelines.core.settings import read_settings  # noqa: E402
from pipelines.core.site import Site  # noqa: E402
from pipelines.engine.steps import Engine  # noqa: E402
from pipelines.engine.store import Store  # noqa: E402
from pipelines.stages.images import Images  # noqa: E402
from pipelines.stages.images.spec import load_image  # noqa: E402


def time_cache_hit(runs: int) -> list[float]:
    """Wall times of `doit image` with its key already in the registry."""
    doit = [sys.executable, "-m", "doit"]
    subprocess.run([*doit, "image"], cwd=REPO, check=True, capture_output=True)  # make sure
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        out = subprocess.run([*doit, "image"], cwd=REPO, check=True, capture_output=True, text=True)
        times.append(time.perf_counter() - start)
        assert "-- image" in out.stdout, out.stdout
    return times


class ImagesOf(Images):
    """The local profile's images stage with its image read from another folder (a copy)."""

    def __init__(self, folder: Path, engine: Engine, site: Site):
        self.image = load_image(folder.name, folder.parent)  # before the steps are made
        super().__init__(context(load_profile("local"), engine, site))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    endpoints = devstack.up()
    site = Site(lambda: (endpoints.registry, (endpoints.docker_host,)))

    hits = time_cache_hit(5)
    print(f"cache hit `doit image`: median {statistics.median(hits):.2f} s (target < 1 s)")

    # The store `doit image` uses (its layer cache too); the base ref as the pipeline resolves it.
    store = Store(read_settings(os.environ).store)
    base = Images(context(load_profile("local"), Engine(store), site)).base_ref()
    ours, plain = [], []
    with tempfile.TemporaryDirectory(prefix="images-bench-") as tmp:
        for _ in range(args.runs):
            folder = image_copy("local-sim", Path(tmp) / uuid.uuid4().hex)
            module = folder / "sim" / "reply.py"  # a changed byte in a COPY: it and after rerun
            module.write_text(module.read_text() + f"# {folder.parent.name}\n")
            engine = Engine(store)  # a fresh one per run: keys are memoized per engine
            images = ImagesOf(folder, engine, site)
            engine.key(images.image_step)  # the plan's key, outside the timing (as before)
            start = time.perf_counter()
            engine.run(images.image_step)  # build, normalize, push
            ours.append(time.perf_counter() - start)
            assert images.plan().base == base
            assert engine.is_done(images.image_step)

            shutil.copyfile(RECEIPT, folder / "sparkforge-receipt.py")
            start = time.perf_counter()
            subprocess.run(
                [
                    "docker",
                    "build",
                    "--no-cache",
                    "--network=host",
                    "--build-arg",
                    f"BASE={base}",
                    "-q",
                    "-t",
                    "sparkforge-bench/plain",
                    str(folder),
                ],
                check=True,
                capture_output=True,
                env={**os.environ, "DOCKER_HOST": endpoints.docker_host},
            )
            plain.append(time.perf_counter() - start)
    o, p = statistics.median(ours), statistics.median(plain)
    print(f"rebuild + normalize + push (ours): median {o:.2f} s over {args.runs}")
    print(f"plain docker build (same engine):   median {p:.2f} s over {args.runs}")
    print(f"ours / plain docker build = {o / p:.2f}")
    values = {"sparkforge: build + normalize + push": o, "plain docker build": p}
    title = f"Rebuild of local-sim after a one-byte change (median of {args.runs})"
    print(f"plot: {bar_chart('images', title, 'seconds (lower is better)', values)}")


if __name__ == "__main__":
    main()
