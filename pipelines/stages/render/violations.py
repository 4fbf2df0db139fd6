"""One violation, one line: the document, the field path, the rule (and its source), the value."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def violation(doc: str, path: Iterable[str | int], rule: str, found: Any) -> str:
    """One line naming the document, the field path, the rule and the value found."""
    dotted = ".".join(str(p) for p in path) or "(document)"
    shown = found if isinstance(found, (int, float, bool)) or found is None else str(found)
    if isinstance(shown, str) and len(shown) > 80:
        shown = shown[:77] + "..."
    return f"{doc}: {dotted}: {rule} (found {shown!r})"
