"""Reproducible by construction, amd64: the same key gives the same digest whatever the build's
clock, zone, locale, umask, hostname, CPUs and file order, for the Debian base and the images
built on it; and the digest each key gave where the project is developed (tests/data/images/)."""

from __future__ import annotations

import pytest
from support.reproducible import (
    REPO,
    assert_one_digest,
    assert_recorded,
    bases_in_registry,
    clean_build,
    plain_builds,
    variation_id,
)
from support.variations import DAYS, YEARS

PLATFORM, ARCH = "linux/amd64", "amd64"
DEBS = REPO / ".cache" / "debs"  # the locked .debs by sha256: inputs, not conditions
# (kind, image, variation): each built again under the variation, compared with a plain build.
# One base for both images (local-sim's is weights-stager's: base same_as), under both
# variations; native debootstraps are cheap beside the emulated ones (test_reproducible_arm64*).
VARIED = [
    ("base", "weights-stager", YEARS),
    ("base", "weights-stager", DAYS),
    # Its wheels come from the package index over TLS, whose certificates a clock three years
    # ahead no longer accepts (a real machine's too): days, not years, for the one that fetches.
    ("image", "weights-stager", DAYS),
    ("image", "local-sim", YEARS),
]
RECORDED = [("base", "weights-stager"), ("image", "weights-stager")]


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """The plain clean build of (kind, image), made once for the module."""
    return plain_builds(PLATFORM, tmp_path_factory, DEBS)


@pytest.fixture(scope="module")
def with_bases(stack, plain, tmp_path_factory):
    """The images' bases in the tests' registry (an image's clean build starts from its base)."""
    bases_in_registry(stack, ["weights-stager"], PLATFORM, tmp_path_factory, plain)


@pytest.mark.stack  # builds of a Debian base, minutes: not the fast lane
@pytest.mark.parametrize(("kind", "image", "variation"), VARIED[:2], ids=variation_id)
def test_two_clean_builds_of_a_base_under_other_conditions_give_one_digest(
    kind, image, variation, plain, tmp_path
):
    varied = clean_build(kind, image, PLATFORM, variation, tmp_path, DEBS)
    assert_one_digest(plain(kind, image), varied, f"{kind} {image} {ARCH}", variation)


@pytest.mark.parametrize(("kind", "image", "variation"), VARIED[2:], ids=variation_id)
def test_two_clean_builds_of_an_image_under_other_conditions_give_one_digest(
    kind, image, variation, plain, with_bases, tmp_path
):
    varied = clean_build(kind, image, PLATFORM, variation, tmp_path, DEBS)
    assert_one_digest(plain(kind, image), varied, f"{kind} {image} {ARCH}", variation)


@pytest.mark.parametrize(("kind", "image"), RECORDED)
def test_the_digest_is_the_one_recorded_for_its_key(kind, image, plain, with_bases):
    tried = sorted({v.describe() for k, i, v in VARIED if (k, i) == (kind, image)})
    assert_recorded(kind, image, ARCH, plain(kind, image), tried)
