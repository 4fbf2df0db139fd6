"""Fabric results in the store, and the bench's verdict on them against the live deployment.

`<store>/fabric/<profile>/<ns>.json` holds one result (and `<ns>-<rank>.log` each member's raw
log). The live deployment is what the deploy stage publishes (`Deploy.live_record`: its record,
`time_ns` and `deployment.key`), handed in by dodo.py; its files are never read here.
"""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NamedTuple

import msgspec

from pipelines.core.errors import BadInput
from pipelines.core.files import MiB, load_json_object, write_atomic
from pipelines.engine.store import Store

PASSED = "passed"
FAILED = "failed"
# A result is its measurements and members: a few KiB; a file past this is not one it wrote.
RESULT_MAX_BYTES = 4 * MiB


class CorruptResult(BadInput):
    """A fabric result that cannot be read: truncated, not JSON, or a field of the wrong type."""


class ResultFields(msgspec.Struct):
    """The fields of a result the bench's verdict reads (the rest is kept as it is)."""

    outcome: str
    failures: list[str] = []
    render_key: str | None = None


class Verdict(NamedTuple):
    """Whether the bench may start: the newest fabric check passed after the live deployment."""

    passed: bool
    when: datetime | None  # when that check ran (None: never)


def results_folder(store: Store, profile: str) -> Path:
    """Where a profile's fabric results are kept."""
    return store.area("fabric") / profile


def write_result(store: Store, result: dict[str, Any], logs: dict[int, str]) -> Path:
    """Keep one result and its members' logs (each file written whole or not at all)."""
    folder = results_folder(store, result["profile"])
    folder.mkdir(parents=True, exist_ok=True)
    ns = time.time_ns()
    for rank, text in sorted(logs.items()):
        write_atomic(folder / f"{ns}-{rank}.log", text.encode())
    path = folder / f"{ns}.json"
    write_atomic(
        path, (json.dumps({**result, "time_ns": ns}, indent=2, sort_keys=True) + "\n").encode()
    )
    return path


def newest(folder: Path) -> dict[str, Any] | None:
    """The newest `<ns>.json` result of a folder, `time_ns` its time."""
    if not folder.is_dir():
        return None
    paths = sorted(
        (p for p in folder.glob("*.json") if p.stem.isdigit()), key=lambda p: int(p.stem)
    )
    if not paths:
        return None
    return {**read_result(paths[-1]), "time_ns": int(paths[-1].stem)}


def read_result(path: Path) -> dict[str, Any]:
    """One result, or CorruptResult with one line naming the file (and field)."""
    return load_json_object(path, RESULT_MAX_BYTES, CorruptResult, ResultFields)


def fabric_refusal(store: Store, profile: str, deployed: dict[str, Any] | None) -> str | None:
    """Why the bench must not start (one line), or None when the fabric check allows it;
    deployed is the live deployment's record (None: nothing deployed)."""
    try:
        check = newest(results_folder(store, profile))
    except CorruptResult as err:
        return (
            f"fabric: profile {profile}: the newest check cannot be read: {err};"
            f" run `doit fabric profile={profile}` again"
        )
    if check is None:
        return f"fabric: profile {profile}: no fabric check; run `doit fabric profile={profile}`"
    when = stamp(check["time_ns"])
    if check["outcome"] != PASSED:
        lines = check.get("failures", [])
        first = f": {lines[0]}" if lines else ""
        return f"fabric: profile {profile}: the check of {when} failed{first}"
    if deployed is not None and check["time_ns"] < deployed["time_ns"]:
        return (
            f"fabric: profile {profile}: the check of {when} is older than the deployment of"
            f" {stamp(deployed['time_ns'])}; run `doit fabric profile={profile}` again"
        )
    key = (deployed or {}).get("deployment", {}).get("key")
    if key and check.get("render_key") and key != check["render_key"]:
        return (
            f"fabric: profile {profile}: the check of {when} ran documents rendered for"
            f" {check['render_key'][:16]}, the deployment is {key[:16]}"
        )
    return None


def fabric_verdict(store: Store, profile: str, deployed: dict[str, Any] | None) -> Verdict:
    """(passed, when): the bench starts only when passed; when is the newest check's time."""
    try:
        check = newest(results_folder(store, profile))
    except CorruptResult:  # the refusal below names it
        check = None
    when = datetime.fromtimestamp(check["time_ns"] / 1e9, UTC) if check else None
    return Verdict(fabric_refusal(store, profile, deployed) is None, when)


def stamp(ns: int) -> str:
    """A record's time, UTC, to the second."""
    return datetime.fromtimestamp(ns / 1e9, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
