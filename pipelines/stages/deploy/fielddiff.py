"""Field-by-field differences between what a deployment wants and what runs: pure functions.

`doit diff` (what a deploy would change), `doit status` (what was changed by hand since the
last deploy) and the deploy's own summary print these, so one shape serves both targets: an
`ObjectDiff` per member or object, each with the `FieldChange`s that make it differ.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

# A value under a name like these is never printed (a hand-set credential in a container's env
# or an object's field would otherwise reach a CI log); only that it changed.
SECRET_NAME = re.compile(
    r"SECRET|TOKEN|PASSWORD|PASSWD|CREDENTIAL|PRIVATE|ACCESS_KEY|API_KEY", re.I
)
# A printed value longer than this is cut in the middle (a ConfigMap holding a program, a whole
# command), keeping both ends: an image reference's digest is at its end.
SHOWN_CHARS = 160
ABSENT = object()  # a field one side does not have


@dataclass(frozen=True)
class FieldChange:
    """One field that differs: its dotted path, the value before and the value after (a diff:
    live, then wanted; drift: applied, then live)."""

    path: str
    before: Any  # ABSENT: not there
    after: Any  # ABSENT: gone

    def line(self) -> str:
        """`path: before -> after`, secrets hidden, long values cut."""
        if SECRET_NAME.search(self.path):
            return f"{self.path}: (value hidden) changed"
        return f"{self.path}: {shown(self.before)} -> {shown(self.after)}"


@dataclass(frozen=True)
class ObjectDiff:
    """What differs on one member or object, and what a deploy would do about it."""

    what: str  # `member localhost (sparkforge-local-0 on unix://...)`, `Job/x in ns`
    action: str  # create, change, replace, restart, delete (prune), keep (prune=no), missing
    fields: tuple[FieldChange, ...] = field(default_factory=tuple)

    def lines(self) -> list[str]:
        """The object's line, then one indented line per field."""
        return [f"{self.what}: {self.action}", *(f"    {f.line()}" for f in self.fields)]


def shown(value: Any) -> str:
    """A value as one short line: JSON, or `(absent)`."""
    if value is ABSENT:
        return "(absent)"
    text = json.dumps(value, sort_keys=True)
    if len(text) <= SHOWN_CHARS:
        return text
    half = (SHOWN_CHARS - 3) // 2
    return text[:half] + "..." + text[-half:]


def shown_type(value: Any) -> str:
    """A JSON value's type in a word (None: nothing there)."""
    return "nothing" if value is None else type(value).__name__


def field_changes(
    wanted: Any, live: Any, extras: bool, drift: bool = False, path: str = ""
) -> list[FieldChange]:
    """Every field where live differs from wanted, by dotted path (live -> wanted; drift:
    wanted -> live, as it was applied and as it is now).

    extras: fields live has and wanted does not count too (False where a server adds its own
    defaults to what was applied). Lists whose items all have a `name` (env, containers,
    volumes) are compared item by item under `[name]`; other lists as whole values.
    """
    if isinstance(wanted, dict) and isinstance(live, dict):
        found = []
        for key in sorted(set(wanted) | (set(live) if extras else set()), key=str):
            found += field_changes(
                wanted.get(key, ABSENT),
                live.get(key, ABSENT),
                extras,
                drift,
                joined(path, str(key)),
            )
        return found
    if named_list(wanted) and named_list(live):
        mine = {item["name"]: item for item in wanted}
        theirs = {item["name"]: item for item in live}
        found = []
        # Items added by hand are drift even where other fields may be a server's defaults.
        for name in [*mine, *(n for n in theirs if n not in mine)]:
            found += field_changes(
                mine.get(name, ABSENT), theirs.get(name, ABSENT), extras, drift, f"{path}[{name}]"
            )
        return found
    if wanted == live:
        return []
    if drift:
        return [FieldChange(path or ".", wanted, live)]
    return [FieldChange(path or ".", live, wanted)]


def named_list(value: Any) -> bool:
    """A non-empty list of objects each with a string `name`."""
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(i, dict) and isinstance(i.get("name"), str) for i in value)
    )


def joined(path: str, key: str) -> str:
    """path.key, the key bracketed when it holds a dot or slash (a label or annotation name)."""
    part = f"[{key}]" if ("." in key or "/" in key) else key
    if not path:
        return part
    return f"{path}{part}" if part.startswith("[") else f"{path}.{part}"


def summary(diffs: list[ObjectDiff], subject: str) -> list[str]:
    """The lines printed for a set of differences: a count, then each object's."""
    if not diffs:
        return [f"{subject}: nothing"]
    fields = sum(len(d.fields) for d in diffs)
    head = f"{subject}: {len(diffs)} member(s)/object(s), {fields} field(s)"
    return [head, *(f"  {line}" for d in diffs for line in d.lines())]
