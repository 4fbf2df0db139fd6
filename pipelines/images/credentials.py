"""Registry credentials from the standard Docker chain (config.json auths and credential helpers).

Credentials are only ever handed to `requests`; they are never printed, logged or stored.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
from pathlib import Path

from pipelines.images.spec import ImageError


def docker_config_path() -> Path:
    """$DOCKER_CONFIG/config.json, else ~/.docker/config.json."""
    folder = os.environ.get("DOCKER_CONFIG") or Path.home() / ".docker"
    return Path(folder) / "config.json"


def registry_credentials(host: str) -> tuple[str, str] | None:
    """(username, secret) for a registry host, or None when the chain has none."""
    path = docker_config_path()
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except ValueError:
        raise ImageError(f"{path}: not valid JSON") from None
    helper = (config.get("credHelpers") or {}).get(host) or config.get("credsStore")
    for key in (host, f"https://{host}", f"http://{host}"):
        entry = (config.get("auths") or {}).get(key)
        if entry and entry.get("auth"):
            user, _, secret = base64.b64decode(entry["auth"]).decode().partition(":")
            return user, secret
    if helper:
        return from_helper(helper, host)
    return None


def from_helper(helper: str, host: str) -> tuple[str, str] | None:
    """Ask `docker-credential-<helper> get` for a host's credentials."""
    try:
        result = subprocess.run(
            [f"docker-credential-{helper}", "get"], input=host, capture_output=True, text=True
        )
    except FileNotFoundError:
        raise ImageError(f"credential helper docker-credential-{helper} not found") from None
    if result.returncode != 0:
        return None  # the helper knows no credentials for this host
    answer = json.loads(result.stdout)
    return answer["Username"], answer["Secret"]
