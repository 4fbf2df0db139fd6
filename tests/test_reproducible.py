"""Reproducible by construction, amd64: the same key gives the same digest whatever the build's
clock, zone, locale, umask, hostname, CPUs and file order, for the Debian base and the images
built on it; the digest each key gave where the project is developed (tests/data/images/) is
the one a build under other conditions gives here."""

from __future__ import annotations

import pytest
from support.reproducible import (
    REPO,
    assert_one_digest,
    assert_reproduces_record,
    in_registry,
    session_builds,
    variation_id,
)
from support.variations import DAYS, YEARS

PLATFORM, ARCH = "linux/amd64", "amd64"
DEBS = REPO / ".cache" / "debs"  # the locked .debs by sha256: inputs, not conditions
# (kind, image, variation): built under the variation, its digest the one recorded for its key
# (a plain build's where the project is developed). One base for both images (local-sim's is
# weights-stager's: base same_as), under the years variation here and the days one on arm64
# (test_reproducible_arm64_bases.py): each variation reaches a debootstrap once a run, and each
# base build is one the images need anyway (their base, pushed under its key).
RECORDED = [
    ("base", "weights-stager", YEARS),
    # Its wheels come from the package index over TLS, whose certificates a clock three years
    # ahead no longer accepts (a real machine's too): days, not years, for the one that fetches.
    ("image", "weights-stager", DAYS),
]
# Not recorded (its key moves with every change to the simulator): compared with a plain build.
VARIED = [("image", "local-sim", YEARS)]


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """The session's clean builds of (kind, image) under a variation, each made once."""
    return session_builds(PLATFORM, tmp_path_factory, DEBS)


@pytest.fixture(scope="module")
def with_bases(stack, builds, tmp_path_factory):
    """The images' bases in the tests' registry (an image's clean build starts from its base)."""
    in_registry(stack, "base", "weights-stager", PLATFORM, tmp_path_factory, builds, YEARS)


@pytest.mark.stack  # builds of a Debian base, minutes: not the fast lane
@pytest.mark.parametrize(("kind", "image", "variation"), RECORDED[:1], ids=variation_id)
def test_a_base_built_under_other_conditions_gives_the_digest_recorded_for_its_key(
    kind, image, variation, builds
):
    assert_reproduces_record(kind, image, ARCH, variation, builds)


@pytest.mark.parametrize(("kind", "image", "variation"), RECORDED[1:], ids=variation_id)
def test_an_image_built_under_other_conditions_gives_the_digest_recorded_for_its_key(
    kind, image, variation, builds, with_bases
):
    assert_reproduces_record(kind, image, ARCH, variation, builds)


@pytest.mark.parametrize(("kind", "image", "variation"), VARIED, ids=variation_id)
def test_two_clean_builds_of_an_image_under_other_conditions_give_one_digest(
    kind, image, variation, builds, with_bases
):
    what = f"{kind} {image} {ARCH}"
    assert_one_digest(builds(kind, image), builds(kind, image, variation), what, variation)
