"""The Sparks' architecture, built here under emulation (qemu-user-static): an arm64 Debian
base built under other conditions gives the digest recorded for its key.
(tests/test_reproducible_arm64.py: the images on them; apart, so two workers share the work.)"""

from __future__ import annotations

import pytest
from support.reproducible import (
    REPO,
    assert_reproduces_record,
    fail_without_emulation,
    session_builds,
    variation_id,
)
from support.variations import DAYS

# Emulated debootstraps take minutes each on a loaded 2-core machine, and a test may wait for
# the base another worker is making (support/reproducible.py): a hang is still stopped.
pytestmark = pytest.mark.timeout(1800)
PLATFORM, ARCH = "linux/arm64", "arm64"
DEBS = REPO / ".cache" / "debs"
# The one base of both images (local-sim's is weights-stager's: base same_as): each emulated
# debootstrap is minutes of CPU, so one variation here, the days one (the years one is the amd64
# base's, test_reproducible.py); the images' module takes this build as their base.
RECORDED = [("base", "weights-stager", DAYS)]


@pytest.fixture(scope="module", autouse=True)
def emulation():
    """This machine runs arm64 binaries (scripts/install registers qemu); else one line."""
    fail_without_emulation(ARCH)


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """The session's clean builds of (kind, image) under a variation, each made once."""
    return session_builds(PLATFORM, tmp_path_factory, DEBS)


@pytest.mark.stack  # builds of a Debian base, minutes: not the fast lane
@pytest.mark.parametrize(("kind", "image", "variation"), RECORDED, ids=variation_id)
def test_an_arm64_base_built_under_other_conditions_gives_the_digest_recorded_for_its_key(
    kind, image, variation, builds
):
    assert_reproduces_record(kind, image, ARCH, variation, builds)
