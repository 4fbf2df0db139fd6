"""Deployment records: one JSON file per deploy, kept as history in the store."""

from __future__ import annotations

import getpass
import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pipelines.files import write_atomic

DEPLOYED = "deployed"
UNCHANGED = "unchanged"
ROLLED_BACK = "rolled back"
REFUSED = "refused"
RESTORED = "restored"
# Outcomes after which the record's deployment is the one running.
LIVE = (DEPLOYED, UNCHANGED, RESTORED)


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

    def write(self, record: dict[str, Any]) -> Path:
        """Keep one record (written whole or not at all); returns its path."""
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"{time.time_ns()}.json"
        write_atomic(path, (json.dumps(record, indent=2, sort_keys=True) + "\n").encode())
        return path

    def history(self) -> list[dict[str, Any]]:
        """All records, oldest first."""
        if not self.folder.is_dir():
            return []
        records = []
        for path in sorted(self.folder.glob("*.json"), key=lambda p: int(p.stem)):
            record = json.loads(path.read_text())
            records.append({**record, "file": path.name, "time_ns": int(path.stem)})
        return records

    def live(self) -> list[dict[str, Any]]:
        """Records after which their deployment was running, oldest first."""
        return [r for r in self.history() if r["outcome"] in LIVE]
