"""Fabric results in the store, beside the deployment records, and the bench's verdict on them.

`<store>/fabric/<profile>/<ns>.json` holds one result (and `<ns>-<rank>.log` each member's raw
log); `<store>/deployments/<profile>/<ns>.json` are the deploy stage's records, read here as the
published files they are (outcome, deployment key).
"""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NamedTuple

from pipelines.files import write_atomic
from pipelines.store import Store

PASSED = "passed"
FAILED = "failed"
LIVE = ("deployed", "unchanged", "restored")  # deploy's outcomes after which it is running


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


def newest(folder: Path, live_only: bool = False) -> dict[str, Any] | None:
    """The newest `<ns>.json` record of a folder (live deployments only, if asked)."""
    if not folder.is_dir():
        return None
    paths = sorted(
        (p for p in folder.glob("*.json") if p.stem.isdigit()), key=lambda p: int(p.stem)
    )
    for path in reversed(paths):
        record = json.loads(path.read_text())
        if not live_only or record.get("outcome") in LIVE:
            return {**record, "time_ns": int(path.stem)}
    return None


def fabric_refusal(store: Store, profile: str) -> str | None:
    """Why the bench must not start (one line), or None when the fabric check allows it."""
    check = newest(results_folder(store, profile))
    deployed = newest(store.area("deployments") / profile, live_only=True)
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


def fabric_verdict(store: Store, profile: str) -> Verdict:
    """(passed, when): the bench starts only when passed; when is the newest check's time."""
    check = newest(results_folder(store, profile))
    when = datetime.fromtimestamp(check["time_ns"] / 1e9, UTC) if check else None
    return Verdict(fabric_refusal(store, profile) is None, when)


def stamp(ns: int) -> str:
    """A record's time, UTC, to the second."""
    return datetime.fromtimestamp(ns / 1e9, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
