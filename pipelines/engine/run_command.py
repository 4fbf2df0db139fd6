"""`doit run` (what `doit TASK` runs), exiting with the code of the error that failed a step.

doit itself exits 1 for any failed task and 2 for an action that raised, so CI could not tell a
bad profile from an unreachable registry or a bench regression. Of what doit offers, a command
plugin replacing `run` (pyproject's `[tool.doit.plugins.command]`, as `explain` is added) is the
one place that both sees every failure and returns the process's exit status: a reporter sees
failures but not the status, and dodo.py's own code ends before any task runs. The failures are
taken from the reporter doit calls (a subclass of the chosen one that also keeps them), not from
module state, because with `-n N` the actions run in other processes and only the failure
objects come back.
"""

from __future__ import annotations

from typing import Any

from doit.cmd_run import Run as DoitRun
from doit.runner import FAILURE

from pipelines.engine.steps import StepFailed


def exit_code(doit_code: int, failures: list[Any]) -> int:
    """doit's code, with its 1 (every failure a failed task) made the first failed step's code.

    Anything doit reports otherwise (2: an action that raised, a dependency error; 3: a bad
    command or task name) is doit's own, and keeps doit's code.
    """
    if doit_code == FAILURE and failures and isinstance(failures[0], StepFailed):
        return failures[0].exit_code
    return doit_code


def keeping_failures(reporter: type, failures: list[Any]) -> type:
    """The reporter class, also appending every failure it is told of to failures."""

    class Keeping(reporter):  # any of doit's reporters
        def add_failure(self, task: Any, fail: Any) -> None:
            failures.append(fail)
            super().add_failure(task, fail)

    Keeping.__name__ = Keeping.__qualname__ = reporter.__name__
    return Keeping


class Run(DoitRun):
    """doit's run command; a run that a step failed exits with that step's error's code."""

    def __init__(self, **kwargs: Any):
        self.failures: list[Any] = []  # before doit's __init__, which asks for the reporters
        super().__init__(**kwargs)

    def get_reporters(self) -> dict[str, type]:
        """doit's reporters (and plugins), each also keeping the failures for the exit code."""
        return {
            name: keeping_failures(reporter, self.failures)
            for name, reporter in super().get_reporters().items()
        }

    def execute(self, params: Any, args: list[str]) -> int:
        """Load the tasks and run them as doit does; the exit code as exit_code says."""
        return exit_code(super().execute(params, args), self.failures)
