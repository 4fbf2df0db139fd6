"""`doit help TASK`, naming the `name=value` arguments the task reads (doit's own help shows a
task's first doc line and its options only: these are not options)."""

from __future__ import annotations

from typing import Any

from doit.cmd_help import Help as DoitHelp

from pipelines.core.progress import show
from pipelines.engine.variables import VARIABLES


def variable_lines(meta: dict[str, Any] | None) -> list[str]:
    """The help lines of the variables a task's meta names (profile for any task)."""
    names = (meta or {}).get("variables") or ["profile"]
    width = max(len(VARIABLES[name][0]) for name in names)
    lines = ["", "reads (after the task name, as doit TASK name=value):"]
    lines += [f"  {VARIABLES[n][0]:<{width}}  {VARIABLES[n][1]}" for n in names]
    return lines


class Help(DoitHelp):  # type: ignore[misc]  # doit is untyped
    """doit's help, and after a task's own lines the variables it reads."""

    def _execute(self, pos_args: list[str]) -> bool:
        found: bool = super()._execute(pos_args)
        if found:
            task = next(t for t in self.task_list if t.name == pos_args[0])
            for line in variable_lines(task.meta):
                show(line)
        return found
