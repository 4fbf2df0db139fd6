"""A request's prompt as the simulator reads it, and the requests vLLM would refuse.

A chat prompt counts the tokens of each message's text content (string, or the "text" parts of
a list), summed; no template tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from .tokenizer import tokenize


class BadRequest(Exception):
    """A request vLLM would refuse: HTTP status, message, error type."""

    def __init__(self, message: str, status: int = 400, kind: str = "BadRequestError"):
        super().__init__(message)
        self.status = status
        self.kind = kind


def flag(value: object) -> bool:
    """A request flag given as a bool (or a bool-like string)."""
    return value is True or (isinstance(value, str) and value.lower() in ("true", "1"))


def text_of(content: object) -> str:
    """The text of a message's content (a string or a list of parts)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"
        )
    raise BadRequest("message content must be a string or a list of parts")


@dataclass
class Prompt:
    """A request's prompt as the simulator reads it."""

    tokens: int
    texts: list[str]  # every message's text, in order
    last_user: str


def chat_prompt(messages: object) -> Prompt:
    """The prompt of a chat request."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list")
    texts, last_user = [], ""
    for m in messages:
        if not isinstance(m, dict) or "role" not in m:
            raise BadRequest("each message needs a 'role'")
        text = text_of(m.get("content"))
        texts.append(text)
        if m["role"] == "user":
            last_user = text
    return Prompt(sum(len(tokenize(t)) for t in texts), texts, last_user)
