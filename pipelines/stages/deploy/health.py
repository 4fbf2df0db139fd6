"""Is a member serving? `/health`, then `/v1/models` naming the model, then one completion."""

from __future__ import annotations

import time
from collections.abc import Callable

from pipelines.core.errors import DeployError

# The HTTP calls (pipelines/core/httpjson.py, the bench's too) are imported by the functions that
# call a member: `doit list` loads this module.


def serves(base_url: str, served_name: str) -> str | None:
    """None when the member serves the model; otherwise why not, in a few words."""
    from pipelines.core.httpjson import HTTPError, get_json

    try:
        health, _ = get_json(f"{base_url}/health", timeout=5)
        if health != 200:
            return f"/health said HTTP {health}"
        status, models = get_json(f"{base_url}/v1/models", timeout=5)
    except HTTPError as err:
        return f"no answer ({type(err).__name__})"
    if status != 200:
        return f"/v1/models said HTTP {status}"
    cards = models.get("data") if isinstance(models, dict) else None
    if not isinstance(cards, list):
        return "/v1/models gave no list of models"
    names = [card.get("id") for card in cards if isinstance(card, dict)]
    if served_name not in names:
        return f"/v1/models lists {names}, expected {served_name!r}"
    return None


def wait_until_serving(
    base_url: str,
    served_name: str,
    timeout_s: float,
    gone: Callable[[], str | None],
    interval_s: float = 0.5,
) -> None:
    """Poll until the member serves the model; DeployError on timeout or when gone() says why."""
    deadline = time.monotonic() + timeout_s
    while True:
        why = serves(base_url, served_name)
        if why is None:
            return
        exited = gone()
        if exited:
            raise DeployError(f"{base_url}: {exited}")
        if time.monotonic() >= deadline:
            raise DeployError(f"{base_url}: not serving after {timeout_s:g} s ({why})")
        time.sleep(interval_s)


def smoke(base_url: str, served_name: str) -> str:
    """One short chat completion; returns its text, DeployError when there is none."""
    from pipelines.core.httpjson import HTTPError, post_json

    body = {
        "model": served_name,
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 8,
        "temperature": 0,
    }
    try:
        status, answer = post_json(f"{base_url}/v1/chat/completions", body, timeout=60)
        text = answer["choices"][0]["message"]["content"] if status == 200 else ""
    except (HTTPError, KeyError, IndexError, TypeError) as err:
        raise DeployError(f"{base_url}: smoke completion failed ({type(err).__name__})") from None
    if not isinstance(text, str) or not text:
        raise DeployError(f"{base_url}: smoke completion gave no text (HTTP {status})")
    return text
