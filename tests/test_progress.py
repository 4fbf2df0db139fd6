"""One progress printer: fetch, ring staging, bench and image builds say their progress through
pipelines/core/progress.py, in one shape of line."""

from __future__ import annotations

import io
import re

from pipelines.core.progress import Progress, say, transfer_line
from pipelines.stages.weights.ring import ring_transfer_line

# That no module prints past the printer is tests/test_contracts.py's (every module of the tree).


def test_a_transfer_line_says_bytes_by_source_rate_and_eta():
    line = transfer_line(1 << 30, 2 << 30, 1 << 30, 10.0, [("S3", 3 << 28), ("peers", 1 << 28)])
    assert line == (
        "1.00 GiB / 2.00 GiB (50%), 768.0 MiB from S3, 256.0 MiB from peers, 107 MB/s, ETA 0:00:10"
    )
    assert transfer_line(0, 100, 0, 5.0) == "0.0 MiB / 0.0 MiB (0%), 0 MB/s, ETA ?"


def test_ring_staging_and_fetch_lines_are_the_same_printers():
    ring = ring_transfer_line(1 << 30, 1 << 29, 1 << 29, 2 << 30, 10.0)
    assert ring == transfer_line(
        1 << 30, 2 << 30, 1 << 30, 10.0, [("S3", 1 << 29), ("peers", 1 << 29)]
    )
    out = io.StringIO()
    progress = Progress("fetch m", 1 << 20, stream=out, interval=3600)
    progress.advance("a", 1 << 19)
    progress.close()
    assert re.fullmatch(
        r"fetch m: 0\.5 MiB / 1\.0 MiB \(50%\), \d+ MB/s, ETA \d:\d\d:\d\d\n", out.getvalue()
    )


def test_say_prints_one_flushed_line_behind_its_prefix():
    out = io.StringIO()
    say("bench", "decode c1: 8 requests", out)
    assert out.getvalue() == "bench: decode c1: 8 requests\n"
