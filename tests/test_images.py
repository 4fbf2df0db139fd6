"""Images on the local stack: built once per key, bit-for-bit reproducible, pushed by digest."""

from __future__ import annotations

import contextlib
import re
import shutil
import tempfile
import time
import uuid
from pathlib import Path

import docker.errors
import pytest

from pipelines import stack as local_stack
from pipelines.images.base import base_key, base_repository, build_base, debian_arch
from pipelines.images.build import (
    RECEIPT,
    build_and_push,
    buildx_available,
    buildx_command,
    choose_builder,
    engine_build,
    plan_image,
)
from pipelines.images.dockerfile import check_contents, check_froms
from pipelines.images.oci import normalize_saved_image
from pipelines.images.registry import Registry
from pipelines.images.spec import ImageError, load_image
from pipelines.statcache import StatCache

WRITES = re.compile(r'"(PUT|POST|PATCH) /v2/')


@pytest.fixture(scope="session")
def registry(stack):
    """The stack's registry."""
    return Registry(stack.registry)


@pytest.fixture(scope="session")
def local_base(stack, registry, tmp_path_factory):
    """The debootstrap base of local-sim, built once (the registry keeps it by key)."""
    spec = load_image("local-sim").spec
    repo, tag = (
        base_repository(spec.base.local),
        f"key-{base_key(spec.base.local, debian_arch())[:32]}",
    )
    digest = registry.manifest_digest(repo, tag)
    if digest is None:
        work = tmp_path_factory.mktemp("base")
        image = build_base(spec.base.local, debian_arch(), spec.source_date_epoch, work)
        digest = registry.push_image(repo, image, [tag])
    return f"{stack.registry}/{repo}@{digest}"


@pytest.fixture
def sim_copy(tmp_path):
    """A copy of images/local-sim with a unique file, so its key has never been built."""
    folder = tmp_path / "images" / "local-sim"
    shutil.copytree(Path(__file__).resolve().parent.parent / "images" / "local-sim", folder)
    (folder / "marker.txt").write_text(uuid.uuid4().hex)
    return folder


def registry_writes(stack_dir: Path) -> int:
    """Write requests the registry has logged so far (pushes of blobs and manifests)."""
    return len(WRITES.findall((stack_dir / "registry.log").read_text()))


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


@pytest.mark.parametrize("name", ["vllm-gb10-dsv41-exl3", "sglang-gb10-dsv41"])
def test_gb10_image_plans_pass_their_static_checks(name, tmp_path):
    image = load_image(name)
    plan = plan_image(image, "ghcr.io/lab", image.spec.base.image, StatCache(tmp_path / "c.db"))
    assert plan.platform == "linux/arm64"
    assert "@sha256:" in plan.base
    text = image.dockerfile.read_text()
    assert "TORCH_CUDA_ARCH_LIST=12.1a" in text and "MAX_JOBS=1" in text
    assert plan.invocation()[:2] == ["env", "SOURCE_DATE_EPOCH=1764460800"]
    assert f"SPARKFORGE_IMAGE_KEY={plan.key}" in plan.invocation()
    again = plan_image(image, "other.registry", image.spec.base.image, StatCache(tmp_path / "d"))
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
    stack, registry, local_base, sim_copy, docker_client, tmp_path
):
    stack_dir = local_stack.resolve_dir()
    cache = StatCache(tmp_path / "c.db")
    plan = plan_image(load_image("local-sim", sim_copy.parent), stack.registry, local_base, cache)
    digest, built = build_and_push(docker_client, registry, plan)
    assert built
    assert registry.manifest_digest(plan.repository, plan.key_tag) == digest

    since, writes = time.time(), registry_writes(stack_dir)
    again, built = build_and_push(docker_client, registry, plan)
    assert (again, built) == (digest, False)
    assert engine_events(docker_client, since) == []  # no build, no container, no tag
    assert registry_writes(stack_dir) == writes  # no push

    server = sim_copy / "server.py"
    server.write_bytes(server.read_bytes().replace(b"Test equipment", b"Test Equipment"))
    changed = plan_image(
        load_image("local-sim", sim_copy.parent), stack.registry, local_base, cache
    )
    assert changed.key != plan.key
    assert build_and_push(docker_client, registry, changed)[1] is True


def test_two_clean_builds_give_one_digest_where_plain_docker_build_gives_two(
    stack, local_base, sim_copy, docker_client, tmp_path
):
    if "docker" not in stack.started:
        pytest.skip("the engine is not the stack's own: its images are not ours to wipe")
    plan = plan_image(
        load_image("local-sim", sim_copy.parent),
        stack.registry,
        local_base,
        StatCache(tmp_path / "c"),
    )
    # A plain `docker build` of the same folder needs the receipt writer in it too.
    shutil.copyfile(RECEIPT, sim_copy / "sparkforge-receipt.py")
    digests, plain_ids = [], []
    for _ in range(2):
        wipe_engine(docker_client)
        with tempfile.TemporaryDirectory(dir=tmp_path) as work:
            engine_build(docker_client, plan, Path(work) / "saved.tar")
            digests.append(
                normalize_saved_image(Path(work) / "saved.tar", plan.epoch, Path(work)).digest
            )
        image, _ = docker_client.images.build(
            path=str(sim_copy), buildargs={"BASE": local_base}, nocache=True, network_mode="host"
        )
        plain_ids.append(image.id)
        docker_client.images.remove(image.id, force=True)
    assert digests[0] == digests[1]
    assert plain_ids[0] != plain_ids[1]


def wipe_engine(client) -> None:
    """Remove every image from the stack's own engine (and with them its build cache)."""
    for _ in range(10):  # a parent goes only after its children: a few passes
        images = client.images.list(all=True)
        if not images:
            return
        for image in images:
            with contextlib.suppress(docker.errors.ImageNotFound, docker.errors.APIError):
                client.images.remove(image.id, force=True)
    raise AssertionError(f"engine still holds {len(client.images.list(all=True))} images")


def test_failing_run_step_names_the_step_and_shows_the_log_tail(
    stack, local_base, sim_copy, docker_client, tmp_path
):
    dockerfile = sim_copy / "Dockerfile"
    dockerfile.write_text(
        dockerfile.read_text().replace(
            "RUN python3", "RUN echo about to fail && exit 3\nRUN python3"
        )
    )
    plan = plan_image(
        load_image("local-sim", sim_copy.parent),
        stack.registry,
        local_base,
        StatCache(tmp_path / "c"),
    )
    with pytest.raises(ImageError) as err:
        engine_build(docker_client, plan, tmp_path / "saved.tar")
    message = str(err.value)
    assert "build failed at Step 6/9 : RUN echo about to fail && exit 3" in message
    assert "about to fail" in message.split("log tail:")[1]
    assert "\n" not in message


def test_unreachable_registry_is_one_clear_line():
    with pytest.raises(ImageError, match=r"^registry 127.0.0.1:1 unreachable \(HEAD "):
        Registry("127.0.0.1:1").manifest_digest("sparkforge/x", "latest")


def test_context_tar_ignores_what_dockerignore_lists(tmp_path):
    from pipelines.images.context import context_files

    (tmp_path / "Dockerfile").write_text("FROM scratch\n")
    (tmp_path / "keep.txt").write_text("k")
    (tmp_path / "secret.env").write_text("s")
    (tmp_path / ".dockerignore").write_text("*.env\n")
    assert "secret.env" not in context_files(tmp_path, {})
    assert "keep.txt" in context_files(tmp_path, {})


def test_builder_is_the_engine_here_and_buildx_builds_from_the_plan(monkeypatch, tmp_path):
    assert not buildx_available()  # no buildx on these machines: the engine builds
    assert choose_builder(has_engine=True) == "engine"
    monkeypatch.setenv("SPARKFORGE_BUILDER", "kaniko")
    with pytest.raises(ImageError, match="expected one of engine, buildx"):
        choose_builder(has_engine=True)
    image = load_image("vllm-gb10-dsv41-exl3")
    plan = plan_image(image, "ghcr.io", image.spec.base.image, StatCache(tmp_path / "c"))
    command = buildx_command(plan, Path("/ctx"), "/out/saved.tar")
    assert command[:5] == ["docker", "buildx", "build", "--platform", "linux/arm64"]
    assert command[-2:] == ["type=docker,dest=/out/saved.tar,rewrite-timestamp=true", "/ctx"]
    assert f"SPARKFORGE_IMAGE_KEY={plan.key}" in command
