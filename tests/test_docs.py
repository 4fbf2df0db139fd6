"""The manual (docs/, mkdocs-material) builds with --strict, and reads right in a real browser:
every page shows the heading it was written with, and every link from one page to another lands
on a page, and an anchor, that exist."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support.browser import browser, page_text

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
EXTERNAL = ("http://", "https://", "mailto:", "data:", "javascript:")


def build_site(site: Path) -> subprocess.CompletedProcess[str]:
    """`mkdocs build --strict` of the manual into site."""
    return subprocess.run(
        [str(BIN / "mkdocs"), "build", "--strict", "--site-dir", str(site)],
        cwd=REPO,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
    )


def written_heading(page: Path) -> str:
    """The first heading a page of the manual was written with."""
    return next(line[2:].strip() for line in page.read_text().splitlines() if line[:2] == "# ")


@pytest.mark.stack  # a browser, a page at a time: seconds, not the fast lane
def test_the_manual_builds_strictly_and_every_page_renders_and_links_in_a_browser(tmp_path, capsys):
    site = tmp_path / "site"
    built = build_site(site)
    assert built.returncode == 0, built.stderr[-3000:]
    doms = {}
    for page in sorted((REPO / "docs").glob("*.md")):
        html = site / f"{page.stem}.html"
        shown = browser("--dump-dom", html.as_uri())
        assert shown.returncode == 0, shown.stderr[-1000:]
        headings = re.findall(r"<h1[^>]*>(.*?)</h1>", shown.stdout, re.S)
        assert headings, f"{html.name}: no heading rendered"
        assert page_text(headings[0]).rstrip(" ¶") == written_heading(page), html.name
        doms[html.name] = shown.stdout
    links = 0
    for name, dom in doms.items():
        for href in re.findall(r'<a [^>]*href="([^"]+)"', dom):
            target, _, anchor = href.partition("#")
            if href.startswith(EXTERNAL) or not (target.endswith(".html") or not target):
                continue  # another site, or the theme's own files (search, assets)
            target = target or name
            assert target in doms, f"{name}: a link to {href}, a page the manual lacks"
            if anchor:
                assert f'id="{anchor}"' in doms[target], f"{name}: {href}: no such anchor"
            links += 1
    with capsys.disabled():
        print(f"\nthe manual in a browser: {len(doms)} pages, {links} links between them:")
        print("  " + ", ".join(doms))
