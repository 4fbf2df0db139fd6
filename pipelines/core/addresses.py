"""Which network addresses never leave this machine: where plain HTTP may be spoken."""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit


def is_loopback(host: str | None) -> bool:
    """Whether host is a literal loopback address (127.0.0.0/8, ::1) or the name localhost:
    a name that only starts like one (localhost.example, 127.0.0.1.example) may be anywhere."""
    if host is None:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_loopback_url(url: str) -> bool:
    """Whether a URL's host is a literal loopback address (is_loopback)."""
    try:
        return is_loopback(urlsplit(url).hostname)
    except ValueError:
        return False
