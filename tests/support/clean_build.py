"""A clean build of an image's base, or of the image on its base, into a folder: what the
reproducibility tests run twice, once under other conditions (support/variations.py).

Run as `python tests/support/clean_build.py base|image FOLDER PLATFORM OUT DEBS`: FOLDER is the
image folder (its name the image's), PLATFORM linux/amd64 or linux/arm64, OUT an empty folder,
DEBS the shared cache of locked .debs (inputs checked by sha256, not build conditions). Prints
one JSON line: the step's key, the image's digest and the folder its image.json is in. The base
is debootstrapped without the registry; the image is built by the engine of the stack named in
the environment (the tests' own), without its cache, on the base that stack's registry holds
for the base's key.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

if __name__ == "__main__":
    # tests/, not tests/support/, first: `support` imports, and support/doit.py would hide doit.
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from support.stages import ImageAt  # noqa: E402

import devstack  # noqa: E402
from pipelines.core.site import Site  # noqa: E402
from pipelines.engine.steps import Engine  # noqa: E402
from pipelines.engine.store import Store  # noqa: E402


def main(kind: str, folder: Path, platform: str, out: Path, debs: Path) -> dict[str, str]:
    """Build and describe one clean build."""

    def stack() -> tuple[str, tuple[str, ...]]:
        endpoints = devstack.read_endpoints()  # asked only by an image build: a base needs none
        return endpoints.registry, (endpoints.docker_host,)

    site = Site(stack)
    engine = Engine(Store(out / "store"))
    images = ImageAt(folder, platform, engine, site)
    work = out / "image"
    work.mkdir()
    if kind == "base":
        from pipelines.stages.images.base import build_base
        from pipelines.stages.images.debian_lock import lock_file
        from pipelines.stages.images.oci import save_image_index

        local = images.image.spec.base.local
        assert local is not None, f"{folder}: no local base"
        step = images.base_step
        assert step is not None
        epoch, lock = images.image.spec.source_date_epoch, lock_file(images.image.base_folder)
        image = build_base(local, lock, images.arch, epoch, work, debs)
        save_image_index(image, work)
    else:
        import docker

        from pipelines.stages.images.build import build_image

        step = images.image_step
        client = docker.DockerClient(base_url=site.docker_host)
        image = build_image(client, images.plan(), "engine", work)
    return {"key": engine.key(step), "digest": image.digest, "folder": str(work)}


if __name__ == "__main__":
    kind, folder, platform, out, debs = sys.argv[1:6]
    result = main(kind, Path(folder), platform, Path(out), Path(debs))
    print(json.dumps(result))
