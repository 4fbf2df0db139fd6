"""Steps keyed by their inputs, and their wiring into doit's task graph."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import botocore.exceptions
import docker.errors
import requests
from doit.exceptions import TaskFailed

from pipelines.errors import PipelineError
from pipelines.keys import key_material, step_key
from pipelines.store import REPO_ROOT, Store


@dataclass(frozen=True, eq=False)
class Step:
    """One keyed unit of work: what it is made from, and the action that writes its output."""

    name: str
    recipe: str
    version: int
    doc: str
    action: Callable[[StepRun], None]
    # A callable is called when the key is first needed: for values another task produces.
    params: Mapping[str, Any] | Callable[[], Mapping[str, Any]] = field(default_factory=dict)
    inputs: Mapping[str, Path] = field(default_factory=dict)
    deps: tuple[Step, ...] = ()


@dataclass(frozen=True)
class StepRun:
    """What an action gets: its output folder and the outputs of the steps it depends on."""

    step: Step
    out: Path
    dep_outputs: Mapping[str, Path]
    params: Mapping[str, Any]

    def dep(self, name: str) -> Path:
        """The output folder of the dependency called name."""
        return self.dep_outputs[name]


# Task name -> (engine, step) for the graph dodo.py declared; read by `doit explain`.
GRAPH: dict[str, tuple[Engine, Step]] = {}


class Engine:
    """Computes step keys (once per process) and runs steps through the store."""

    def __init__(self, store: Store | None = None, root: Path = REPO_ROOT):
        self.store = store or Store()
        self.root = Path(root)
        self._materials: dict[str, dict[str, Any]] = {}

    def input_digests(self, step: Step) -> dict[str, str]:
        """Content digests of a step's input files and folders, by input name."""
        paths = {name: self._resolve(path) for name, path in step.inputs.items()}
        for name, path in paths.items():
            if not path.exists():
                raise PipelineError(f"step {step.name}: input {name!r} not found: {path}")
        files = [p for p in paths.values() if not p.is_dir()]
        file_digests = self.store.statcache.digest_files(files)
        return {
            name: self.store.statcache.digest_tree(path) if path.is_dir() else file_digests[path]
            for name, path in paths.items()
        }

    def material(self, step: Step) -> dict[str, Any]:
        """The key material of a step (memoized: inputs are digested once per process)."""
        if step.name not in self._materials:
            params = step.params() if callable(step.params) else step.params
            self._materials[step.name] = key_material(
                step.recipe,
                step.version,
                params,
                self.input_digests(step),
                {dep.name: self.key(dep) for dep in step.deps},
            )
        return self._materials[step.name]

    def key(self, step: Step) -> str:
        """The step's key."""
        return step_key(self.material(step))

    def is_done(self, step: Step) -> bool:
        """True when output for the step's current key is stored."""
        return self.store.has(self.key(step))

    def output(self, step: Step) -> Path:
        """The stored output folder of a step that is done."""
        return self.store.output_dir(self.key(step))

    def run(self, step: Step) -> Path:
        """Produce the step's output (or find it stored) and return its folder."""
        key = self.key(step)
        dep_outputs = {dep.name: self.output(dep) for dep in step.deps}
        record = {"name": step.name, **self.material(step)}
        started = time.monotonic()
        out, built = self.store.build(
            key,
            record,
            lambda out: step.action(StepRun(step, out, dep_outputs, record["params"])),
        )
        took = time.monotonic() - started
        print(f"{step.name}: {'built' if built else 'stored'} {key[:16]} ({took:.2f} s)")
        return out

    def _resolve(self, path: Path) -> Path:
        return (self.root / path).absolute()

    def task(self, step: Step, **extra: Any) -> dict[str, Any]:
        """The doit task dict of a step: staleness decided by its key, never by doit's MD5."""
        GRAPH[step.name] = (self, step)
        return {
            "basename": step.name,
            "doc": step.doc,
            "actions": [(self._doit_action, [step])],
            "uptodate": [lambda: self._uptodate(step)],
            "task_dep": [dep.name for dep in step.deps],
            "verbosity": 2,
            **extra,
        }

    def _uptodate(self, step: Step) -> bool:
        try:
            return self.is_done(step)
        except PipelineError:
            return False  # the action reports the error in one line

    def _doit_action(self, step: Step) -> dict[str, str] | TaskFailed:
        failed = as_doit_action(lambda: self.run(step))()
        return failed or {"key": self.key(step)}


# Failures of the outside world (disk, network, S3, registry, engine) a person can act on.
OUTSIDE_ERRORS = (
    OSError,
    botocore.exceptions.BotoCoreError,
    botocore.exceptions.ClientError,
    requests.RequestException,
    docker.errors.DockerException,
)


def as_doit_action(work: Callable[[], Any]) -> Callable[[], Any]:
    """A doit action that reports a failure as one line and a failed task (no traceback)."""

    def action():
        try:
            work()
        except PipelineError as err:
            return TaskFailed(str(err))
        except OUTSIDE_ERRORS as err:
            return TaskFailed(f"{type(err).__name__}: {err}")

    return action


def side_task(
    name: str,
    doc: str,
    work: Callable[[], Any],
    uptodate: Callable[[], bool] | None = None,
    deps: Sequence[str] = (),
) -> dict[str, Any]:
    """A doit task whose output lives outside the store (S3, blobs, registry).

    Its uptodate check asks that place directly; without one the task runs when asked.
    """
    task = {
        "basename": name,
        "doc": doc,
        "actions": [as_doit_action(work)],
        "task_dep": list(deps),
        "verbosity": 2,
    }
    if uptodate is not None:
        task["uptodate"] = [uptodate]
    return task
