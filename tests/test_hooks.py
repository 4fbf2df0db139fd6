"""The checks scripts/test runs: local pre-commit hooks only, each a tool of .venv (no network)."""

from __future__ import annotations

from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent


def test_every_hook_is_local_and_runs_a_tool_of_the_venv():
    config = yaml.safe_load((REPO / ".pre-commit-config.yaml").read_text())
    assert {repo["repo"] for repo in config["repos"]} == {"local"}
    hooks = [hook for repo in config["repos"] for hook in repo["hooks"]]
    assert {hook["id"] for hook in hooks} == {"ruff", "ruff-format", "lint-imports", "mypy"}
    assert [h["id"] for h in hooks if not h["entry"].startswith(".venv/bin/")] == []
    assert {hook["language"] for hook in hooks} == {"unsupported"}


def test_the_test_command_runs_the_hooks_before_pytest():
    lines = (REPO / "scripts" / "test").read_text().splitlines()
    hooks = lines.index(".venv/bin/pre-commit run --all-files --show-diff-on-failure")
    runs = [
        i
        for i, line in enumerate(lines)
        if line.removeprefix("exec ").startswith(".venv/bin/pytest")
    ]
    assert runs and hooks < min(runs)
