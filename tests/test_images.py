"""Images on the local stack: built once per key, bit-for-bit reproducible, pushed by digest."""

from __future__ import annotations

import contextlib
import dataclasses
import re
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

import docker.errors
import pytest
import yaml
from support import stages
from support.registry_repos import delete_repository
from support.variations import YEARS

import devstack as local_stack
from pipelines.core.errors import BadInput
from pipelines.core.paths import IMAGES_DIR, RECEIPT
from pipelines.core.profiles import load_profile
from pipelines.core.schema import replace
from pipelines.core.settings import read_settings
from pipelines.core.site import Site
from pipelines.engine.steps import Engine
from pipelines.engine.store import Store
from pipelines.stages.images import Images
from pipelines.stages.images.build import (
    build_image,
    buildx_available,
    buildx_command,
    choose_builder,
)
from pipelines.stages.images.debian_lock import LOCK_NAME
from pipelines.stages.images.dockerfile import check_contents, check_froms
from pipelines.stages.images.registry import Registry
from pipelines.stages.images.registry_cache import RegistryCache
from pipelines.stages.images.spec import ImageError, load_image


class ImagesOf(Images):
    """The images stage of a profile with its image read from another folder (a copy)."""

    def __init__(self, folder: Path, engine: Engine, site: Site, profile="local"):
        self.image = load_image(folder.name, folder.parent)  # before the steps are made
        super().__init__(stages.context(load_profile(profile), engine, site))


@pytest.fixture(scope="session")
def registry(stack):
    """The stack's registry."""
    return Registry(stack.registry)


@pytest.fixture(scope="session")
def site(stack):
    """The local profile's site: the stack's registry and engine."""
    return Site(lambda: (stack.registry, (stack.docker_host,)))


@pytest.fixture(scope="session")
def copies(stack):
    """A site that pushes test copies of local-sim under a namespace of their own, removed
    from the shared registry at the end (its deletes are enabled; see devstack)."""
    namespace = f"sparkforge-test-{uuid.uuid4().hex[:8]}"
    yield Site(lambda: (stack.registry, (stack.docker_host,)), namespace)
    delete_repository(stack.registry, f"{namespace}/sparkforge/local-sim")


@pytest.fixture(scope="session")
def native_builds(tmp_path_factory):
    """The session's clean builds for this machine's architecture, each made once and shared
    with the reproducibility tests (support/reproducible.py)."""
    from support.reproducible import REPO, session_builds

    from pipelines.stages.images.inputs import debian_arch

    return session_builds(f"linux/{debian_arch()}", tmp_path_factory, REPO / ".cache" / "debs")


@pytest.fixture(scope="session")
def local_base(stack, registry, site, native_builds, tmp_path_factory):
    """The debootstrap base of local-sim (weights-stager's): the session's one clean build of
    it (support/reproducible.py, the one test_reproducible.py checks), which the registry then
    keeps by key."""
    from support.reproducible import in_registry

    from pipelines.stages.images.inputs import debian_arch

    native = f"linux/{debian_arch()}"
    in_registry(stack, "base", "weights-stager", native, tmp_path_factory, native_builds, YEARS)
    engine = Engine(Store(tmp_path_factory.mktemp("base-store")))
    images = Images(stages.context(load_profile("local"), engine, site))
    engine.run(images.base_step)  # found in the registry: builds nothing
    ref = images.base_ref()
    repository, digest = images.base_step.cache.repository, ref.rsplit("@", 1)[1]
    tag = RegistryCache.key_tag(engine.key(images.base_step))
    assert registry.manifest_digest(repository, tag) == digest
    assert ref == f"{stack.registry}/{repository}@{digest}"
    return ref


@pytest.fixture
def sim_copy(tmp_path):
    """A copy of images/local-sim with a unique file, so its key has never been built."""
    folder = stages.image_copy("local-sim", tmp_path / "images")
    (folder / "marker.txt").write_text(uuid.uuid4().hex)
    return folder


def registry_writes(stack_dir: Path, repository: str) -> int:
    """Write requests to a repository the registry has logged so far (pushes of blobs and
    manifests; other workers push to other repositories meanwhile)."""
    log = (stack_dir / "registry.log").read_text()
    return len(re.findall(rf'"(?:PUT|POST|PATCH) /v2/{re.escape(repository)}/', log))


def engine_events(client, since: float) -> list[dict]:
    """Image and container events of the engine since a time."""
    return [
        e
        for e in client.events(since=since, until=time.time() + 0.1, decode=True)
        if e.get("Type") in ("image", "container")
    ]


def test_unpinned_from_is_refused_with_file_line_and_expectation(tmp_path):
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text("# runtime\nARG BASE=ubuntu:22.04\nFROM ${BASE}\nRUN true\n")
    with pytest.raises(ImageError) as err:
        check_froms(dockerfile, dockerfile.read_text(), {})
    assert str(err.value) == (
        f"{dockerfile}:3: FROM ${{BASE}} resolves to 'ubuntu:22.04': expected an image pinned by"
        " digest (name@sha256:<64 hex>)"
    )
    pinned = "ubuntu@sha256:" + "a" * 64
    assert check_froms(dockerfile, dockerfile.read_text(), {"BASE": pinned}) == [pinned]


def gb10_images(name: str, registry: str, store: Path) -> Images:
    """The images stage of a ring profile running the image `name`, pushing to registry."""
    profile = replace(load_profile("tp3-ring"), image=name)
    return Images(stages.context(profile, Engine(Store(store)), Site.named(registry)))


@pytest.mark.parametrize("name", ["vllm-gb10-dsv41-exl3", "sglang-gb10-dsv41"])
def test_gb10_image_plans_pass_their_static_checks(name, tmp_path):
    images = gb10_images(name, "ghcr.io/lab", tmp_path / "c")
    assert images.base_step is None  # a pinned base: nothing to build here
    plan = images.plan()
    assert plan.key == images.engine.key(images.image_step)
    assert plan.repository == f"lab/sparkforge/{name}"
    assert plan.platform == "linux/arm64"
    assert "@sha256:" in plan.base
    text = images.image.dockerfile.read_text()
    assert "TORCH_CUDA_ARCH_LIST=12.1a" in text and "MAX_JOBS=1" in text
    assert plan.invocation()[:2] == ["env", "SOURCE_DATE_EPOCH=1764460800"]
    assert f"SPARKFORGE_IMAGE_KEY={plan.key}" in plan.invocation()
    again = gb10_images(name, "other.registry", tmp_path / "d").plan()
    assert again.key == plan.key  # the key does not depend on where the image is pushed


def test_sglang_image_refuses_a_second_visible_nccl(tmp_path):
    image = load_image("sglang-gb10-dsv41")
    text = image.dockerfile.read_text() + "ENV LD_LIBRARY_PATH=/usr/lib/nccl:/usr/lib\n"
    with pytest.raises(ImageError, match="two NCCL runtimes"):
        check_contents(image.dockerfile, text, image.spec)
    without_arch = image.dockerfile.read_text().replace("TORCH_CUDA_ARCH_LIST=12.1a", "X=1")
    with pytest.raises(ImageError, match="TORCH_CUDA_ARCH_LIST=12.1a"):
        check_contents(image.dockerfile, without_arch, image.spec)


def test_local_sim_is_built_once_per_key_and_a_changed_byte_rebuilds(
    stack, registry, copies, local_base, sim_copy, private_stack, private_engine, tmp_path, capsys
):
    stack_dir = local_stack.resolve_dir()
    store = Store(tmp_path / "store")  # one store (and stat cache) across the "runs" below
    # Built on an engine of the module's own: its events are this test's alone (other workers
    # build and run containers on the session's engine meanwhile).
    site = Site(lambda: (stack.registry, (private_stack.docker_host,)), copies.namespace)
    engine = Engine(store)
    images = ImagesOf(sim_copy, engine, site)
    key = engine.key(images.image_step)
    repository = images.image_step.cache.repository
    assert repository.endswith("/sparkforge/local-sim")  # under the copies' own namespace
    assert registry.manifest_digest(repository, RegistryCache.key_tag(key)) is None
    capsys.readouterr()
    engine.run(images.image_step)
    said = capsys.readouterr().out
    assert f"image: built {key[:16]} in registry" in said
    # The base's layer, which the base's repository holds, is mounted from it, not sent again.
    base_repository = local_base.rpartition("@")[0].partition("/")[2]
    assert re.search(rf"^push: [0-9a-f]{{12}}: .* mounted from {base_repository}$", said, re.M)
    digest = registry.manifest_digest(repository, RegistryCache.key_tag(key))
    assert digest is not None
    (candidate,) = images.image_step.cache.extra_tags()  # the checkout's commit, as CI tags
    assert re.fullmatch(r"candidate-[0-9a-f]{12}", candidate)
    assert registry.manifest_digest(repository, candidate) is not None
    assert images.image_ref() == f"{stack.registry}/{repository}@{digest}"
    assert images.plan().base == local_base

    # A second run (a new process: a fresh engine) finds the key in the registry.
    since, writes = time.time(), registry_writes(stack_dir, repository)
    engine = Engine(store)
    again = ImagesOf(sim_copy, engine, site)
    assert engine.key(again.image_step) == key
    assert engine.is_done(again.image_step)
    engine.run(again.image_step)
    assert f"image: found {key[:16]} in registry" in capsys.readouterr().out
    assert again.image_ref() == f"{stack.registry}/{repository}@{digest}"
    assert engine_events(private_engine, since) == []  # no build, no container, no tag
    assert registry_writes(stack_dir, repository) == writes  # no push

    module = sim_copy / "sim" / "reply.py"
    module.write_bytes(module.read_bytes() + b"# one byte more\n")
    engine = Engine(store)
    changed = ImagesOf(sim_copy, engine, site)
    changed_key = engine.key(changed.image_step)
    assert changed_key != key
    assert not engine.is_done(changed.image_step)
    engine.run(changed.image_step)
    assert f"image: built {changed_key[:16]} in registry" in capsys.readouterr().out
    changed_digest = registry.manifest_digest(repository, RegistryCache.key_tag(changed_key))
    assert changed_digest not in (None, digest)


def test_two_clean_builds_give_one_digest_where_plain_docker_build_gives_two(
    local_base, native_builds, sim_copy, private_engine
):
    # Ours: the session's two clean builds of local-sim, the second under other conditions
    # (test_reproducible.py's, made once a run and shared: no third build of the same key).
    ours = [native_builds("image", "local-sim"), native_builds("image", "local-sim", YEARS)]
    # A plain `docker build` of the same folder needs the receipt writer in it too.
    shutil.copyfile(RECEIPT, sim_copy / "sparkforge-receipt.py")
    plain_ids = []
    for _ in range(2):
        wipe_engine(private_engine)  # an engine no other test uses: nothing cached
        image, _ = private_engine.images.build(
            path=str(sim_copy),
            buildargs={"BASE": local_base},
            nocache=True,
            network_mode="host",
            rm=True,
            forcerm=True,
        )
        plain_ids.append(image.id)
        private_engine.images.remove(image.id, force=True)
    assert ours[0].digest == ours[1].digest
    assert plain_ids[0] != plain_ids[1]


def test_a_clean_build_of_local_sim_gives_the_digest_the_registry_holds_for_its_key(
    site, local_base, private_engine, tmp_path
):
    # Reproducible across runs, machines and versions of this code: the registry's image of
    # a key was built before (by an earlier version, maybe), and a build now must match it.
    engine = Engine(Store(tmp_path / "store"))
    images = Images(stages.context(load_profile("local"), engine, site))
    engine.run(images.image_step)  # the registry holds the key from now on (built, or found)
    pushed = images.image_ref().rsplit("@", 1)[1]
    wipe_engine(private_engine)  # no cached steps: a clean build
    with tempfile.TemporaryDirectory(dir=tmp_path) as work:
        assert build_image(private_engine, images.plan(), "engine", Path(work)).digest == pushed


def wipe_engine(client) -> None:
    """Remove every image from an engine (and with them its build cache)."""
    for _ in range(10):  # a parent goes only after its children: a few passes
        images = client.images.list(all=True)
        if not images:
            return
        for image in images:
            with contextlib.suppress(docker.errors.ImageNotFound, docker.errors.APIError):
                client.images.remove(image.id, force=True)
    raise AssertionError(f"engine still holds {len(client.images.list(all=True))} images")


def test_failing_run_step_names_the_step_and_shows_the_log_tail(
    stack, registry, copies, local_base, sim_copy, tmp_path
):
    dockerfile = sim_copy / "Dockerfile"
    dockerfile.write_text(
        dockerfile.read_text().replace(
            "RUN python3", "RUN echo about to fail && exit 3\nRUN python3"
        )
    )
    engine = Engine(Store(tmp_path / "store"))
    images = ImagesOf(sim_copy, engine, copies)
    with pytest.raises(ImageError) as err:
        engine.run(images.image_step)
    message = str(err.value)
    assert "build failed at Step 7/10 : RUN echo about to fail && exit 3" in message
    assert "about to fail" in message.split("log tail:")[1]
    assert "\n" not in message
    key_tag = RegistryCache.key_tag(engine.key(images.image_step))
    assert registry.manifest_digest(images.image_step.cache.repository, key_tag) is None


def test_unreachable_registry_is_one_clear_line():
    with pytest.raises(ImageError, match=r"^registry 127.0.0.1:1 unreachable \(HEAD "):
        Registry("127.0.0.1:1").manifest_digest("sparkforge/x", "latest")


def test_context_tar_ignores_what_dockerignore_lists(tmp_path):
    from pipelines.stages.images.context import context_files

    (tmp_path / "Dockerfile").write_text("FROM scratch\n")
    (tmp_path / "keep.txt").write_text("k")
    (tmp_path / "secret.env").write_text("s")
    (tmp_path / ".dockerignore").write_text("*.env\n")
    assert "secret.env" not in context_files(tmp_path, {})
    assert "keep.txt" in context_files(tmp_path, {})


def test_builder_is_the_engine_here_and_buildx_builds_from_the_plan(tmp_path):
    assert not buildx_available()  # no buildx on these machines: the engine builds
    assert choose_builder(has_engine=True) == "engine"
    assert choose_builder(has_engine=False) == "engine"  # no buildx either: nothing else
    builder = read_settings({"SPARKFORGE_BUILDER": "kaniko"}).builder
    with pytest.raises(ImageError, match="expected one of engine, buildx"):
        choose_builder(True, builder)
    assert choose_builder(True, read_settings({"SPARKFORGE_BUILDER": "buildx"}).builder) == (
        "buildx"
    )
    plan = gb10_images("vllm-gb10-dsv41-exl3", "ghcr.io", tmp_path / "c").plan()
    command = buildx_command(plan, Path("/ctx"), "/out/saved.tar")
    assert command[:5] == ["docker", "buildx", "build", "--platform", "linux/arm64"]
    assert command[-2:] == ["type=docker,dest=/out/saved.tar,rewrite-timestamp=true", "/ctx"]
    assert f"SPARKFORGE_IMAGE_KEY={plan.key}" in command


def test_a_file_capability_set_in_a_build_is_in_the_container_of_the_normalized_image(
    copies, local_base, sim_copy, private_engine, tmp_path
):
    # `setcap cap_net_bind_service+ep` written by the build (the base has python3, not setcap):
    # the engine exports it as a SCHILY.xattr record, and the normalized image must keep it.
    capability = "0100000200040000000000000000000000000000"
    dockerfile = sim_copy / "Dockerfile"
    dockerfile.write_text(
        dockerfile.read_text()
        + "RUN python3 -c \"import os; p = '/opt/sparkforge/bind'; open(p, 'w').close();"
        + f" os.setxattr(p, 'security.capability', bytes.fromhex('{capability}'))\"\n"
    )
    engine = Engine(Store(tmp_path / "store"))
    images = ImagesOf(sim_copy, engine, copies)
    engine.run(images.image_step)  # built, normalized, pushed
    ref = images.image_ref()
    wipe_engine(private_engine)  # the container runs from the registry's bytes, nothing cached
    private_engine.images.pull(ref)
    read = "import os; print(os.getxattr('/opt/sparkforge/bind', 'security.capability').hex())"
    out = private_engine.containers.run(
        ref, ["python3", "-c", read], network_mode="host", remove=True
    )
    assert out.decode().strip() == capability


class ArrivalClock:
    """A stdout that notes when each line arrives."""

    def __init__(self) -> None:
        self.lines: list[tuple[float, str]] = []

    def write(self, text: str) -> int:
        self.lines += [(time.monotonic(), line) for line in text.splitlines() if line]
        return len(text)

    def flush(self) -> None:
        """Nothing is held back."""


def test_a_builds_output_appears_while_it_runs(
    copies, local_base, sim_copy, private_engine, tmp_path, monkeypatch
):
    dockerfile = sim_copy / "Dockerfile"
    dockerfile.write_text(dockerfile.read_text() + "RUN echo watch-this-line && sleep 6\n")
    plan = ImagesOf(sim_copy, Engine(Store(tmp_path / "store")), copies).plan()
    clock = ArrivalClock()
    monkeypatch.setattr(sys, "stdout", clock)
    build_image(private_engine, plan, "engine", tmp_path)
    (at,) = [n for n, (_, line) in enumerate(clock.lines) if line.endswith(": watch-this-line")]
    assert clock.lines[at][1] == "image local-sim: watch-this-line"
    # Printed when the step printed it: the engine's next line comes after the sleep.
    assert clock.lines[at + 1][0] - clock.lines[at][0] > 5
    normalized = [line for _, line in clock.lines if " normalized: " in line]
    assert normalized and normalized[-1].startswith(f"image: layer {len(normalized)}/")


def test_buildx_reads_and_writes_its_layer_cache_where_ci_says(tmp_path):
    # CI's ring builds start with an empty machine: buildx's own cache lives in the registry.
    cache = "ghcr.io/lab/sparkforge/buildcache:tp3-ring"
    settings = read_settings({"SPARKFORGE_BUILDX_CACHE": cache})
    assert settings.buildx_cache == cache
    images = gb10_images("vllm-gb10-dsv41-exl3", "ghcr.io", tmp_path / "c")
    images.buildx_cache = settings.buildx_cache
    plan = images.plan()
    command = buildx_command(plan, Path("/ctx"), "/out/saved.tar")
    assert command[command.index("--cache-from") + 1] == f"type=registry,ref={cache}"
    assert command[command.index("--cache-to") + 1] == (
        f"type=registry,ref={cache},mode=max,image-manifest=true"
    )
    assert plan.key == images.engine.key(images.image_step)  # speed, not bytes: not in the key
    for bad in ("ghcr.io/lab:x,type=local,dest=/tmp", "lab", "ghcr.io/lab:tag=1"):
        with pytest.raises(BadInput) as refused:
            read_settings({"SPARKFORGE_BUILDX_CACHE": bad})
        assert str(refused.value) == (
            f"environment SPARKFORGE_BUILDX_CACHE={bad!r}: expected registry/repository:tag"
        )


def test_a_runner_with_an_empty_store_restores_the_layers_another_normalized(
    stack, s3, s3_in_environment, copies, local_base, sim_copy, private_stack, tmp_path, capsys
):
    # CI's runners start empty: the normalized layers travel in the remote cache, so a second
    # runner re-compresses nothing and pushes the same image.
    from pipelines.core.signing.namedkeys import keygen
    from pipelines.engine.remote import remote_cache

    public = keygen("layers-test", tmp_path / "key")
    url = f"s3://models/layer-cache-test-{uuid.uuid4().hex[:8]}"
    writer = remote_cache(url, (tmp_path / "key").read_text(), (), False)
    reader = remote_cache(url, None, (public,), False)
    other = f"{copies.namespace}-b"
    digests, hows = [], []
    try:
        for store, remote, namespace in (("a", writer, copies.namespace), ("b", reader, other)):
            site = Site(lambda: (stack.registry, (private_stack.docker_host,)), namespace)
            engine = Engine(Store(tmp_path / store), remote=remote)
            images = ImagesOf(sim_copy, engine, site)
            engine.run(images.image_step)  # each namespace lacks the key: a build
            out = capsys.readouterr().out
            hows.append(re.findall(r"^image: layer \d+/\d+ (\w+): ", out, re.MULTILINE))
            digests.append(images.image_ref().rsplit("@", 1)[1])
    finally:
        delete_repository(stack.registry, f"{other}/sparkforge/local-sim")
        bucket, prefix = url[5:].split("/", 1)
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for found in page.get("Contents", []):
                s3.delete_object(Bucket=bucket, Key=found["Key"])
    assert hows[0] and set(hows[0]) == {"normalized"}
    assert hows[1] == ["restored"] * len(hows[0])
    assert digests[0] == digests[1]


@pytest.mark.parametrize(
    ("entry", "says"),
    [
        (None, "is not registered"),
        (
            "disabled\ninterpreter /usr/libexec/qemu-binfmt/aarch64-binfmt-P\nflags: PF\n",
            "not enabled",
        ),
        ("enabled\ninterpreter /usr/libexec/qemu-binfmt/aarch64-binfmt-P\nflags: P\n", "F flag"),
    ],
)
def test_a_build_for_arm64_where_emulation_is_missing_is_one_line_saying_what_to_run(
    entry, says, tmp_path, monkeypatch
):
    from pipelines.stages.images import emulation
    from pipelines.stages.images.base import build_base
    from pipelines.stages.images.debian_lock import lock_file
    from pipelines.stages.images.inputs import debian_arch

    foreign = "arm64" if debian_arch() == "amd64" else "amd64"
    handler = tmp_path / f"qemu-{emulation.QEMU_NAMES[foreign]}"
    if entry is not None:
        handler.write_text(entry)
    monkeypatch.setattr(emulation, "BINFMT", tmp_path)
    image = load_image("local-sim")
    assert image.spec.base.local is not None
    lock = lock_file(image.base_folder)
    with pytest.raises(ImageError) as refused:
        build_base(image.spec.base.local, lock, foreign, 0, tmp_path, tmp_path)
    line = str(refused.value)
    assert "\n" not in line and says in line and "scripts/install" in line
    assert str(handler) in line


@pytest.mark.parametrize("platform", ["linux/amd64", "linux/arm64"])
def test_local_sim_builds_on_weights_stagers_base_one_step_key_per_platform(platform, tmp_path):
    """`base: same_as` shares one debootstrap: the same lock, packages and date, so one key
    (one build, one registry tag, one reproducibility check) for both images."""
    keys, locks = {}, {}
    for name in ["local-sim", "weights-stager"]:
        engine = Engine(Store(tmp_path / name))
        images = stages.ImageAt(IMAGES_DIR / name, platform, engine, stages.NO_SITE)
        assert images.base_step is not None
        keys[name], locks[name] = engine.key(images.base_step), images.base_step.inputs
    assert keys["local-sim"] == keys["weights-stager"]
    assert locks["local-sim"] == {"debian_lock": IMAGES_DIR / "weights-stager" / LOCK_NAME}
    assert not (IMAGES_DIR / "local-sim" / LOCK_NAME).exists()  # no second lock to drift


def shared_base_error(images: Path) -> str:
    """The one line loading local-sim from images gives, or a failure."""
    with pytest.raises(ImageError) as refused:
        load_image("local-sim", images)
    assert "\n" not in str(refused.value)
    return str(refused.value)


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (
            {"local-sim": {"base": {"same_as": "local-sim"}}},
            "local-sim/image.yaml: field 'base.same_as': expected another image of {images}"
            " (sglang-gb10-dsv41, vllm-gb10-dsv41-exl3, weights-stager), got 'local-sim'",
        ),
        (
            {"local-sim": {"base": {"same_as": "no-such-image"}}},
            "local-sim/image.yaml: field 'base.same_as': expected another image of {images}"
            " (sglang-gb10-dsv41, vllm-gb10-dsv41-exl3, weights-stager), got 'no-such-image'",
        ),
        (
            {"local-sim": {"base": {"same_as": "vllm-gb10-dsv41-exl3"}}},
            "local-sim/image.yaml: field 'base.same_as': expected an image whose base is made"
            " here (base.local), got 'vllm-gb10-dsv41-exl3'",
        ),
        (  # a chain (or a loop): the other image's base must be its own
            {"weights-stager": {"base": {"same_as": "local-sim"}}},
            "local-sim/image.yaml: field 'base.same_as': expected an image whose base is made"
            " here (base.local), got 'weights-stager'",
        ),
        (
            {"local-sim": {"source_date_epoch": 1764547200}},
            "local-sim/image.yaml: field 'source_date_epoch': expected 1764460800, the date of"
            " weights-stager's base, which this image shares (base.same_as), got 1764547200",
        ),
        (
            {"local-sim": {"base": {"same_as": "weights-stager", "local": {"suite": "bookworm"}}}},
            "local-sim/image.yaml: field 'base': base needs exactly one of 'image' (pinned by"
            " digest), 'local' or 'same_as' (another image's local base)",
        ),
    ],
    ids=["itself", "unknown", "pinned", "chain", "another-date", "two-bases"],
)
def test_a_base_same_as_that_cannot_be_shared_is_one_line_naming_the_field(
    edit, expected, tmp_path
):
    images = tmp_path / "images"
    shutil.copytree(IMAGES_DIR, images, ignore=shutil.ignore_patterns("__py*"))
    for name, changes in edit.items():
        spec_file = images / name / "image.yaml"
        spec = yaml.safe_load(spec_file.read_text())
        spec.update(changes)
        spec_file.write_text(yaml.safe_dump(spec))
    assert shared_base_error(images) == f"{images}/{expected.format(images=images)}"


def test_a_platform_argument_other_than_amd64_or_arm64_is_refused_in_one_line(tmp_path):
    engine = Engine(Store(tmp_path / "store"))
    with pytest.raises(
        BadInput, match=r"platform='linux/s390x': expected linux/amd64 or linux/arm64"
    ):
        Images(stages.context(load_profile("local"), engine, platform="linux/s390x"))


def test_debootstrap_runs_dpkg_without_fsyncs_and_with_every_default_dpkg_keeps():
    """DPKG_FORCE replaces dpkg's built-in force defaults: the base's environment names each of
    them, as this machine's dpkg lists them ([*] in --force-help), and unsafe-io besides."""
    import subprocess

    from pipelines.stages.images.base import build_environment

    listed = subprocess.run(["dpkg", "--force-help"], capture_output=True, text=True).stdout
    defaults = set(re.findall(r"^\s*\[\*\]\s+(\S+)", listed, re.MULTILINE))
    assert defaults, listed  # the help's form moved: read it again
    forced = set(build_environment({}, 0)["DPKG_FORCE"].split(","))
    assert defaults | {"unsafe-io"} == forced


def test_debootstrap_sees_one_environment_whatever_the_callers_but_the_clock_it_is_given():
    """The builds under varied conditions (test_reproducible*.py) prove the digest; this says
    which of a caller's variables reach debootstrap at all: only the preload that moves the
    clock, as those builds do."""
    from pipelines.stages.images.base import build_environment

    caller = {"PYTHONDONTWRITEBYTECODE": "", "PATH": "/opt/other/bin", "TZ": "Asia/Kolkata",
              "LANG": "de_DE.UTF-8", "PYTHONHASHSEED": "7", "HOME": "/home/x", "FAKETIME": "+1d",
              "LD_PRELOAD": "/usr/lib/faketime.so"}  # fmt: skip
    env = build_environment(caller, 1764460800)
    assert {k: v for k, v in env.items() if k not in ("DPKG_FORCE",)} == {
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "SOURCE_DATE_EPOCH": "1764460800",
        "PYTHONDONTWRITEBYTECODE": "1",
        "FAKETIME": "+1d",
        "LD_PRELOAD": "/usr/lib/faketime.so",
    }


@pytest.mark.parametrize(
    ("ref", "repository"),
    [
        (
            "registry.lab:5000/sparkforge/base-bookworm@sha256:" + "a" * 64,
            "sparkforge/base-bookworm",
        ),
        ("registry.lab:5000/lab/sglang@sha256:" + "a" * 64, "lab/sglang"),
        # Docker Hub's (no host), and another registry's: no repository of this one to mount.
        ("lmsysorg/sglang@sha256:" + "a" * 64, None),
        ("registry.lab/sparkforge/base-bookworm@sha256:" + "a" * 64, None),
        ("ghcr.io/lab/base@sha256:" + "a" * 64, None),
    ],
)
def test_a_push_mounts_only_from_a_base_on_the_images_own_registry(ref, repository):
    from pipelines.stages.images.inputs import repository_on

    assert repository_on(ref, "registry.lab:5000") == repository


def test_the_base_key_moves_with_the_date_its_build_is_given_not_with_its_description(
    tmp_path, monkeypatch
):
    """debootstrap runs dated the image's source_date_epoch (shadow's days, .pyc stamps, the
    layer's mtimes): two epochs are two bases, so two keys; a description is no input."""
    import msgspec

    from pipelines.stages.images import tasks as image_tasks
    from pipelines.stages.images.spec import ImageDir

    real = image_tasks.load_image

    def base_key(**changes: object) -> str:
        def changed(name: str) -> ImageDir:
            image = real(name)
            return dataclasses.replace(image, spec=msgspec.structs.replace(image.spec, **changes))

        monkeypatch.setattr(image_tasks, "load_image", changed)
        engine = Engine(Store(tmp_path / "store"))
        images = Images(stages.context(load_profile("local"), engine))
        assert images.base_step is not None  # local-sim's base (weights-stager's) is made here
        return engine.key(images.base_step)

    key = base_key()
    epoch = load_image("local-sim").spec.source_date_epoch
    assert base_key(description="the same base, described otherwise") == key
    assert base_key(source_date_epoch=epoch + 86_400) != key
