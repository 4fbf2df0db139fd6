"""`doit explain TASK`: why a step would run, against the newest stored output of that step."""

from __future__ import annotations

import sys
from typing import Any

from doit.cmd_base import DoitCmdBase
from doit.exceptions import InvalidCommand

from pipelines.core.errors import PipelineError
from pipelines.engine.steps import GRAPH, Engine, Step


def diff_files(before: dict[str, str], after: dict[str, str]) -> str:
    """The files of a folder input that changed, were added or removed, as one clause."""
    parts = []
    for label, names in (
        ("changed", [n for n in after if n in before and before[n] != after[n]]),
        ("added", [n for n in after if n not in before]),
        ("removed", [n for n in before if n not in after]),
    ):
        if names:
            parts.append(f"{label}: {', '.join(sorted(names))}")
    return f" ({'; '.join(parts)})" if parts else ""


def diff_material(
    old: dict[str, Any], new: dict[str, Any], files: dict[str, dict[str, str]] | None = None
) -> list[str]:
    """Lines naming each part of the key material that differs between two records.

    For folder inputs, the files inside that differ are named too (files: the new listings).
    """
    lines = []
    for field in ("recipe", "version"):
        if old.get(field) != new[field]:
            lines.append(f"{field}: {old.get(field)!r} -> {new[field]!r}")
    for section in ("params", "inputs", "deps"):
        before, after = old.get(section, {}), new[section]
        for name in sorted(before.keys() | after.keys()):
            if name not in before:
                lines.append(f"{section}.{name}: added ({short(after[name])})")
            elif name not in after:
                lines.append(f"{section}.{name}: removed (was {short(before[name])})")
            elif before[name] != after[name]:
                detail = ""
                if section == "inputs" and files and name in files:
                    detail = diff_files(old.get("files", {}).get(name, {}), files[name])
                line = f"{section}.{name}: {short(before[name])} -> {short(after[name])}"
                lines.append(line + detail)
    return lines


def short(value: Any) -> str:
    """A digest cut to 16 hex characters; any other value as its repr."""
    if isinstance(value, str) and len(value) == 64:
        return value[:16]
    return repr(value)


def explain_step(engine: Engine, step: Step, indent: str = "") -> list[str]:
    """Why step would run (or that it would not), following changed dependencies down."""
    key = engine.key(step)
    if engine.is_done(step):
        where = engine.cache(step).name
        return [f"{indent}{step.name}: up to date ({key[:16]} is in the {where})"]
    records, corrupt = engine.store.readable_records(step.name)
    lines = [f"{indent}{step.name}: skipped a record: {why}" for why in corrupt]
    if not records:
        return lines + [f"{indent}{step.name}: would run: no output of this step is stored yet"]
    newest = records[0]
    lines += [
        f"{indent}{step.name}: would run: key {key[:16]} is not stored;"
        f" against the newest stored output ({newest['key'][:16]}):"
    ]
    material = engine.material(step)
    files = engine.listings(step)
    lines += [f"{indent}  {line}" for line in diff_material(newest, material, files)]
    for dep in step.deps:
        if newest.get("deps", {}).get(dep.name) != material["deps"][dep.name]:
            lines += explain_step(engine, dep, indent + "    ")
    return lines


class Explain(DoitCmdBase):
    """doit command: say which inputs changed since a step's newest stored output."""

    name = "explain"
    doc_purpose = "say why a step would run: what changed since its newest stored output"
    doc_usage = "TASK [TASK ...]"
    doc_description = None
    cmd_options = ()

    def _execute(self, pos_args: list[str]) -> int:
        if not pos_args:
            raise InvalidCommand("`explain` needs at least one task name")
        for name in pos_args:
            if name not in GRAPH:
                known = ", ".join(sorted(GRAPH)) or "none"
                raise InvalidCommand(f"{name!r} is not a keyed step (keyed steps: {known})")
            engine, step = GRAPH[name]
            try:
                lines = explain_step(engine, step)
            except PipelineError as err:  # a service it asks is down: one line, as a step says
                sys.stderr.write(f"error: {err}\n")
                return err.exit_code
            for line in lines:
                self.outstream.write(line + "\n")
        return 0
