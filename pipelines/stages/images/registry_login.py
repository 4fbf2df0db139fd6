"""Logging in to a registry as Docker does: the credential chain (credHelpers, credsStore,
auths), then Basic or a Bearer token from the realm the challenge names, which credentials
reach only over HTTPS (plain HTTP only on a literal loopback address)."""

from __future__ import annotations

import base64
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pipelines.core.addresses import is_loopback
from pipelines.stages.images.spec import ImageBadInput, ImageError


@dataclass(frozen=True)
class Credentials:
    """What the Docker chain holds for a registry; never printed (repr hides the secrets)."""

    username: str = field(repr=False)
    password: str | None = field(repr=False)
    identity_token: str | None = field(default=None, repr=False)


def docker_config_path() -> Path:
    """$DOCKER_CONFIG/config.json, else ~/.docker/config.json (where `docker login` writes)."""
    folder = os.environ.get("DOCKER_CONFIG") or Path.home() / ".docker"
    return Path(folder) / "config.json"


def registry_credentials(host: str) -> Credentials | None:
    """A registry's credentials as Docker resolves them: credHelpers, credsStore, then auths."""
    import docker.auth  # only a login needs the SDK
    import docker.errors

    try:
        config = docker.auth.load_config(str(docker_config_path()))
        found: dict[str, Any] | None = config.resolve_authconfig(host)
    except docker.errors.DockerException as err:
        raise ImageBadInput(f"{docker_config_path()}: credentials for {host}: {err}") from None
    if not found:
        return None
    entry = {k.lower(): v for k, v in found.items()}
    return Credentials(entry.get("username", ""), entry.get("password"), entry.get("identitytoken"))


def login(host: str, challenge: str) -> dict[str, str]:
    """The Authorization header a registry's WWW-Authenticate challenge asks for (Basic or
    Bearer), from the Docker credential chain."""
    import urllib3

    from pipelines.core.httpjson import http_pool

    creds = registry_credentials(host)
    if creds is None:
        raise ImageError(
            f"registry {host} wants credentials: none in the Docker chain"
            f" ({docker_config_path()}; `docker login {host}`)"
        )
    scheme, _, params = challenge.partition(" ")
    basic = f"{creds.username}:{creds.password}"
    if scheme.lower() == "basic" and creds.password is not None:
        return {"Authorization": f"Basic {base64.b64encode(basic.encode()).decode()}"}
    fields = dict(re.findall(r'(\w+)="([^"]*)"', params))
    if scheme.lower() != "bearer" or "realm" not in fields:
        raise ImageError(f"registry {host}: unsupported authentication {scheme!r}")
    realm = trusted_realm(host, fields["realm"])
    query = {k: v for k, v in fields.items() if k in ("service", "scope")}
    try:
        if creds.identity_token:
            # An identity token is an OAuth2 refresh token (distribution's token spec).
            form = {**query, "grant_type": "refresh_token", "client_id": "sparkforge"}
            form["refresh_token"] = creds.identity_token
            r = http_pool().request("POST", realm, fields=form, encode_multipart=False)
        else:
            auth = urllib3.make_headers(basic_auth=basic)
            r = http_pool().request("GET", realm, fields=query, headers=auth)
    except urllib3.exceptions.HTTPError as err:
        raise ImageError(f"registry {host}: token service: {type(err).__name__}") from None
    if r.status != 200:
        raise ImageError(f"registry {host}: token service said HTTP {r.status}")
    answer = r.json()
    return {"Authorization": f"Bearer {answer.get('token') or answer.get('access_token')}"}


def trusted_realm(host: str, realm: str) -> str:
    """The token realm a challenge names, if credentials may go there: HTTPS, or plain
    HTTP to a literal loopback address (the registry cannot send them elsewhere)."""
    try:
        parts = urlsplit(realm)
        realm_host = parts.hostname
    except ValueError:
        parts, realm_host = None, None
    if parts is not None and realm_host and parts.scheme == "https":
        return realm
    if parts is not None and parts.scheme == "http" and is_loopback(realm_host):
        return realm
    raise ImageError(
        f"registry {host}: token realm {realm[:200]!r} refused: credentials go only"
        " to an https:// realm (plain http:// only on 127.0.0.0/8, ::1 or localhost)"
    )
