"""What writes an image layer's bytes, as one value every image key includes.

Kept apart from `oci` so that computing a key imports no tar or gzip code.
"""

from __future__ import annotations

import zlib

NORMALIZER_VERSION = 2  # 2: PAX headers, extended attributes kept
# gzip framing: no file name, mtime 0 (Python writes OS 255, XFL 4 at this level), deflate
# at level 1 with zlib's default window and memory: the same bytes on every run. Level 1, as
# go-containerregistry's tarball layers: a 185 MB base tar deflated in 1.8 CPU s where level 6
# took 5.5, to 61 MB where level 6 made 56 (docs/caching.md).
GZIP_LEVEL = 1


def layer_format() -> dict[str, str | int]:
    """The normalizer's version, tar format and deflate level, and the zlib that deflates.

    zlib's version is there because two zlib builds may deflate one tar into different bytes:
    a machine with another zlib computes another key instead of other bytes under one key.
    """
    return {
        "normalizer": NORMALIZER_VERSION,
        "tar": "pax",
        "gzip_level": GZIP_LEVEL,
        "zlib": zlib.ZLIB_RUNTIME_VERSION,
    }
