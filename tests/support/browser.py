"""A real headless Chromium for the tests that look at a page as a person would."""

from __future__ import annotations

import re
import shutil
import subprocess
from html import unescape

BROWSER = "chromium-headless-shell"  # Debian's; scripts/install puts it there


def browser(*args: str) -> subprocess.CompletedProcess[str]:
    """The headless browser with a fresh profile (root runs it without the sandbox)."""
    found = shutil.which(BROWSER)
    assert found, f"{BROWSER} is not installed: run scripts/install"
    command = [found, "--headless", "--no-sandbox", "--disable-gpu", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def page_text(dom: str) -> str:
    """What the page says: the DOM's text, tags and style dropped, spaces collapsed."""
    dom = re.sub(r"<style.*?</style>", " ", dom, flags=re.S)
    return " ".join(unescape(re.sub(r"<[^>]+>", " ", dom)).split())
