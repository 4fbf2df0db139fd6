"""The Sparks' architecture, built and run here under emulation (qemu-user-static): the arm64
weights-stager, the image the Sparks run that builds here, gives the digest recorded for its key
under another build's conditions, and stages a small model from the local S3 in an arm64
container (the bases: tests/test_reproducible_arm64_bases.py)."""

from __future__ import annotations

import hashlib
import time

import pytest
from support.ports import spare_ports
from support.reproducible import (
    REPO,
    assert_reproduces_record,
    fail_without_emulation,
    in_registry,
    session_builds,
    variation_id,
)
from support.variations import DAYS

from pipelines.stages.deploy.ringstage import (
    PLAN_PARENT,
    plan_archive,
    s3_environment,
    stager_command,
)
from pipelines.stages.weights.ringplan import RingNode, plan_json, plan_ring

# Emulated debootstraps take minutes each on a loaded 2-core machine, and a test may wait for
# the base another worker is making (support/reproducible.py): a hang is still stopped.
pytestmark = pytest.mark.timeout(1800)
PLATFORM, ARCH = "linux/arm64", "arm64"
DEBS = REPO / ".cache" / "debs"
# Built under the variation, its digest the one recorded for its key (test_reproducible.py).
# local-sim is built plain and varied on amd64 only (test_reproducible.py): the Sparks never run
# it, and what makes an image's bytes (the context, the layers' normalization) is this machine's
# code on either architecture; two emulated builds of it were some 40 CPU s of every run.
RECORDED = [("image", "weights-stager", DAYS)]  # its wheels come over TLS: test_reproducible.py


@pytest.fixture(scope="module", autouse=True)
def emulation():
    """This machine runs arm64 binaries (scripts/install registers qemu); else one line."""
    fail_without_emulation(ARCH)


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """The session's clean builds of (kind, image) under a variation, each made once."""
    return session_builds(PLATFORM, tmp_path_factory, DEBS)


@pytest.fixture(scope="module")
def with_bases(stack, builds, tmp_path_factory):
    """The images' arm64 bases in the tests' registry (test_reproducible_arm64_bases.py's)."""
    in_registry(stack, "base", "weights-stager", PLATFORM, tmp_path_factory, builds, DAYS)


@pytest.mark.parametrize(("kind", "image", "variation"), RECORDED, ids=variation_id)
def test_an_arm64_image_built_under_other_conditions_gives_the_digest_recorded_for_its_key(
    kind, image, variation, builds, with_bases
):
    assert_reproduces_record(kind, image, ARCH, variation, builds)


@pytest.fixture(scope="module")
def arm64_stager(stack, builds, with_bases, tmp_path_factory):
    """The arm64 weights-stager image the step finds by its key: the build held to its record."""
    return in_registry(stack, "image", "weights-stager", PLATFORM, tmp_path_factory, builds, DAYS)


def test_the_arm64_stager_stages_a_small_model_from_s3_in_an_arm64_container(
    arm64_stager, synthetic, stack_env, docker_client, tmp_path, capsys
):
    _, lock = synthetic
    entries = [(e.name, e.locked_size, e.locked_sha256) for e in lock.files]
    node = RingNode("spark-a", "127.0.0.1", {})
    plan = plan_ring(lock.model, lock.source, "0" * 64, entries, [node], spare_ports())
    root = tmp_path / "weights"
    root.mkdir()
    docker_client.images.pull(arm64_stager)
    container = docker_client.containers.create(
        arm64_stager,
        stager_command(0, str(root), "model", 1.0),
        network_mode="host",
        environment=s3_environment(stack_env),
        volumes={str(root): {"bind": str(root), "mode": "rw"}},
    )
    try:
        container.put_archive(PLAN_PARENT, plan_archive(plan_json(plan)))
        started = time.monotonic()
        container.start()
        status = container.wait(timeout=600)["StatusCode"]
        took = time.monotonic() - started
        log = container.logs().decode(errors="replace")
        machine = docker_client.containers.run(
            arm64_stager, entrypoint=["uname", "-m"], remove=True
        ).decode()
    finally:
        container.remove(force=True)
    assert status == 0, f"the arm64 stager exited {status}: {log[-2000:]}"
    assert machine.strip() == "aarch64"
    staged = root / "model"
    for entry in lock.files:
        path = staged / entry.name
        assert path.is_file(), f"{entry.name}: not staged; log: {log[-1000:]}"
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        assert digest == entry.locked_sha256, f"{entry.name}: staged bytes do not verify"
    size = sum(e.locked_size for e in lock.files)
    with capsys.disabled():
        files = len(lock.files)
        print(f"\narm64 stager under emulation: {files} files, {size} bytes, {took:.1f} s")
        print(log.strip())


def test_the_stager_verifies_tls_with_the_bundle_of_its_wheels_not_a_system_store(
    arm64_stager, docker_client
):
    # The base has no ca-certificates (images/weights-stager/image.yaml): botocore must find
    # certifi's bundle, or every https S3 endpoint would fail to verify on a Spark.
    probe = (
        "import os, botocore.httpsession as h; p = h.get_cert_path(True);"
        " print(p, os.path.getsize(p), os.path.exists('/etc/ssl/certs/ca-certificates.crt'))"
    )
    out = docker_client.containers.run(
        arm64_stager, entrypoint=["python3", "-c", probe], remove=True
    ).decode()
    path, size, system_store = out.split()
    assert path == "/opt/sparkforge/lib/certifi/cacert.pem" and int(size) > 100_000, out
    assert system_store == "False", out
