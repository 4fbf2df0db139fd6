"""The Sparks' architecture, built here under emulation (qemu-user-static): the arm64 Debian
bases give one digest per key whatever the build's conditions, the digest recorded for it.
(tests/test_reproducible_arm64.py: the images on them; apart, so two workers share the work.)"""

from __future__ import annotations

import pytest
from support.reproducible import (
    REPO,
    assert_one_digest,
    assert_recorded,
    clean_build,
    fail_without_emulation,
    plain_builds,
    variation_id,
)
from support.variations import YEARS

# Emulated debootstraps take minutes each on a loaded 2-core machine, and a test may wait for
# the plain build another worker is making (support/reproducible.py): a hang is still stopped.
pytestmark = pytest.mark.timeout(1800)
PLATFORM, ARCH = "linux/arm64", "arm64"
DEBS = REPO / ".cache" / "debs"
# The one base of both images (local-sim's is weights-stager's: base same_as): each emulated
# debootstrap is minutes of CPU, so one variation here, both on amd64 (test_reproducible.py).
VARIED = [("base", "weights-stager", YEARS)]


@pytest.fixture(scope="module", autouse=True)
def emulation():
    """This machine runs arm64 binaries (scripts/install registers qemu); else one line."""
    fail_without_emulation(ARCH)


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """The plain clean build of (kind, image), made once for the module."""
    return plain_builds(PLATFORM, tmp_path_factory, DEBS)


@pytest.mark.stack  # builds of a Debian base, minutes: not the fast lane
@pytest.mark.parametrize(("kind", "image", "variation"), VARIED, ids=variation_id)
def test_two_clean_arm64_builds_of_a_base_under_other_conditions_give_one_digest(
    kind, image, variation, plain, tmp_path
):
    varied = clean_build(kind, image, PLATFORM, variation, tmp_path, DEBS)
    assert_one_digest(plain(kind, image), varied, f"{kind} {image} {ARCH}", variation)


@pytest.mark.stack  # as above
@pytest.mark.parametrize(("kind", "image", "variation"), VARIED, ids=variation_id)
def test_the_arm64_digest_of_a_base_is_the_one_recorded_for_its_key(kind, image, variation, plain):
    assert_recorded(kind, image, ARCH, plain(kind, image), [variation.describe()])
