"""Deployment records: one JSON file per deploy, kept as history in the store."""

from __future__ import annotations

import getpass
import json
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

from pipelines.core.errors import BadInput
from pipelines.core.files import MiB, load_json_object, write_atomic
from pipelines.core.progress import say

DEPLOYED = "deployed"
UNCHANGED = "unchanged"
ROLLED_BACK = "rolled back"
REFUSED = "refused"
RESTORED = "restored"
# Outcomes after which the record's deployment is the one running.
LIVE = (DEPLOYED, UNCHANGED, RESTORED)
# A record holds its rendered documents: some 100 KiB for a ring; a file past this is not one
# that deploy wrote.
RECORD_MAX_BYTES = 16 * MiB


class CorruptDeploymentRecord(BadInput):
    """A record that cannot be read: truncated, not JSON, or without a field a reader uses."""


class KeptDeployment(msgspec.Struct):
    """What a record keeps of its deployment (Deployment.as_record), as its readers use it."""

    key: str
    documents: list[dict[str, Any]] = []
    image: str = ""
    engines: list[str] = []


class DeploymentFields(msgspec.Struct):
    """The fields of a record that status, rollback, fabric and the bench read, each of its
    type; a missing one reads as its default (records keep fields beyond these)."""

    outcome: str
    deployment: KeptDeployment
    finished: float = 0.0
    who: str = "unknown"
    lock_sha256: str = "unknown"
    git: str = "unknown"


def who_ran(environ: Mapping[str, str]) -> str:
    """The CI run (GitHub Actions) or the user who ran the deploy."""
    if environ.get("GITHUB_RUN_ID"):
        repo = environ.get("GITHUB_REPOSITORY", "")
        return f"github-actions {repo} run {environ['GITHUB_RUN_ID']}"
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return f"uid {os.getuid()}"


class Records:
    """The deployment history of one profile: `<store>/deployments/<profile>/<ns>.json`."""

    def __init__(self, folder: Path):
        self.folder = folder
        # Records that could not be read, each a line; said once each per process.
        self.corrupt: dict[Path, str] = {}

    def write(self, record: dict[str, Any]) -> Path:
        """Keep one record (written whole or not at all); returns its path."""
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"{time.time_ns()}.json"
        write_atomic(path, (json.dumps(record, indent=2, sort_keys=True) + "\n").encode())
        return path

    def history(self) -> list[dict[str, Any]]:
        """All records that can be read, oldest first; each one that cannot is named in one
        line on stderr and left out (the others still tell what is deployed)."""
        if not self.folder.is_dir():
            return []
        records = []
        for path in sorted(self.folder.glob("*.json"), key=record_order):
            try:
                record = read_record(path)
            except CorruptDeploymentRecord as err:
                self.skip(path, str(err))
                continue
            records.append({**record, "file": path.name, "time_ns": int(path.stem)})
        return records

    def skip(self, path: Path, why: str) -> None:
        """Say once that a record is left out, and why."""
        if path not in self.corrupt:
            self.corrupt[path] = why
            say("deploy records", f"skipped {why}", stream=sys.stderr)

    def refuse_unread_after(self, time_ns: int, action: str) -> None:
        """Refuse, in one line, to act on the history when a record newer than time_ns could
        not be read: it may be the live deployment's, so what is live is not known."""
        newer = [p for p in self.corrupt if p.stem.isdigit() and int(p.stem) > time_ns]
        if newer:
            raise CorruptDeploymentRecord(
                f"{action} refused: {self.corrupt[max(newer, key=record_order)]}; it is newer"
                " than every record that can be read, so what is live is not known: repair or"
                " remove it, then run it again"
            )

    def live(self) -> list[dict[str, Any]]:
        """Records after which their deployment was running, oldest first."""
        return [r for r in self.history() if r["outcome"] in LIVE]


def record_order(path: Path) -> tuple[int, str]:
    """Records by their time (the name's digits); other names first, to be named as corrupt."""
    return (int(path.stem), "") if path.stem.isdigit() else (-1, path.name)


def read_record(path: Path) -> dict[str, Any]:
    """One record, or CorruptDeploymentRecord with one line naming the file (and field)."""
    if not path.stem.isdigit():
        raise CorruptDeploymentRecord(f"{path}: not a record's name (<time_ns>.json)")
    record = load_json_object(path, RECORD_MAX_BYTES, CorruptDeploymentRecord, DeploymentFields)
    # Checked above: the fields convert, each a default where the record lacks it.
    fields = msgspec.to_builtins(msgspec.convert(record, DeploymentFields))
    return {**record, **fields, "deployment": {**record["deployment"], **fields["deployment"]}}
