"""Steps keyed by their inputs, and their wiring into doit's task graph.

The engine imports no stage and no outside-world library: a stage translates the errors of
the services it talks to into PipelineError where they happen, and brings its own cache
backend (the registry) when its output does not live in the store.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from doit.exceptions import TaskFailed

from pipelines.core.errors import PipelineError
from pipelines.core.paths import REPO_ROOT
from pipelines.core.progress import say
from pipelines.engine.keys import key_material, step_key
from pipelines.engine.statcache import StatCache
from pipelines.engine.store import Store, read_record
from pipelines.engine.variables import reading


class Cache(Protocol):
    """Where a step's output lives once complete: the store, a registry, a remote cache."""

    @property
    def name(self) -> str:
        """What explain and the messages call it."""

    def has(self, key: str) -> bool:
        """True when complete output for key is there."""

    def publish(self, key: str, work: Path, record: dict[str, Any]) -> None:
        """Make the finished work folder (its out/) the output of key, all or nothing."""


class RemoteCache(Cache, Protocol):
    """A cache shared between machines, layered under the store for store-backed steps."""

    writable: bool

    def restore(self, key: str, out: Path) -> dict[str, Any] | None:
        """Fill out with key's verified output and return its record; None when absent.

        Raises PipelineError (one line) when an entry is there but must not be used.
        """


class Input(Protocol):
    """An input that digests itself (e.g. a build context with its ignore rules)."""

    def digest(self, statcache: StatCache) -> tuple[str, dict[str, str]]:
        """(digest, name -> file digest) of what the step reads."""


@dataclass(frozen=True)
class Sources:
    """A package folder's source files as an input: a step keyed by the code that makes its
    output (the bytecode caches beside it differ between machines, so they are left out)."""

    folder: Path

    def digest(self, statcache: StatCache) -> tuple[str, dict[str, str]]:
        """(digest, relative path -> file digest) of the folder's files, bytecode excluded."""
        return statcache.tree_listing(self.folder, exclude=("__pycache__",))


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
    inputs: Mapping[str, Path | Input] = field(default_factory=dict)
    deps: tuple[Step, ...] = ()
    # Digests of published outputs made elsewhere (a base image pinned by digest): key deps.
    pins: Callable[[], Mapping[str, str]] | None = None
    # Where the output lives; None for the store.
    cache: Cache | None = None
    # doit tasks to run first that are not keyed steps (their outputs enter through params).
    after: tuple[str, ...] = ()


@dataclass(frozen=True)
class StepRun:
    """What an action gets: its output folder and the outputs of the steps it depends on."""

    step: Step
    out: Path
    dep_outputs: Mapping[str, Path]
    params: Mapping[str, Any]
    key: str = ""

    def dep(self, name: str) -> Path:
        """The output folder of the dependency called name."""
        return self.dep_outputs[name]


# Task name -> (engine, step) for the graph dodo.py declared; read by `doit explain`.
GRAPH: dict[str, tuple[Engine, Step]] = {}


class Engine:
    """Computes step keys (once per process) and runs steps through the store or their cache."""

    def __init__(self, store: Store, root: Path = REPO_ROOT, remote: RemoteCache | None = None):
        self.store = store
        self.root = Path(root)
        self.remote = remote
        self._asked_remote: set[str] = set()
        self._materials: dict[str, dict[str, Any]] = {}
        self._files: dict[str, dict[str, dict[str, str]]] = {}

    def input_digests(self, step: Step) -> tuple[dict[str, str], dict[str, dict[str, str]]]:
        """(digest by input name, file listing by folder input name) of a step's inputs."""
        statcache = self.store.statcache
        digests: dict[str, str] = {}
        listings: dict[str, dict[str, str]] = {}
        paths = {}
        for name, source in step.inputs.items():
            if not isinstance(source, Path):
                digests[name], listings[name] = source.digest(statcache)
                continue
            path = (self.root / source).absolute()
            if not path.exists():
                raise PipelineError(f"step {step.name}: input {name!r} not found: {path}")
            if path.is_dir():
                digests[name], listings[name] = statcache.tree_listing(path)
            else:
                paths[name] = path
        files = statcache.digest_files(paths.values())
        digests.update((name, files[path]) for name, path in paths.items())
        return dict(sorted(digests.items())), listings

    def material(self, step: Step) -> dict[str, Any]:
        """The key material of a step (memoized: inputs are digested once per process)."""
        if step.name not in self._materials:
            params = step.params() if callable(step.params) else step.params
            digests, listings = self.input_digests(step)
            deps = {dep.name: self.key(dep) for dep in step.deps}
            deps.update(step.pins() if step.pins else {})
            self._materials[step.name] = key_material(
                step.recipe, step.version, params, digests, deps
            )
            self._files[step.name] = listings
        return self._materials[step.name]

    def listings(self, step: Step) -> dict[str, dict[str, str]]:
        """The files inside each folder input of a step (not part of the key; for explain)."""
        self.material(step)
        return self._files[step.name]

    def key(self, step: Step) -> str:
        """The step's key."""
        return step_key(self.material(step))

    def cache(self, step: Step) -> Cache:
        """The backend holding the step's output."""
        return step.cache or self.store

    def is_done(self, step: Step) -> bool:
        """True when output for the step's current key exists where the step keeps it; a
        store-backed step's output found in the remote cache is restored into the store."""
        key = self.key(step)
        if step.cache is not None:
            return step.cache.has(key)
        if self.store.has(key):
            changed = self.store.changed(key)
            if not changed:
                return True
            # Edited by hand, or damaged: never taken as done. Set aside, then made again.
            shown = ", ".join(changed[:5]) + (
                f" and {len(changed) - 5} more" if changed[5:] else ""
            )
            say(
                step.name,
                f"stored output {key[:16]} differs from its record: {shown}; making it again",
            )
            self.store.set_aside(key)
        return self.restore(step, key)

    def restore(self, step: Step, key: str) -> bool:
        """Restore key's output from the remote cache (once per process); False to build it."""
        if self.remote is None or key in self._asked_remote:
            return False
        self._asked_remote.add(key)
        remote = self.remote
        started = time.monotonic()
        try:
            restored = self.store.restore(key, lambda out: remote.restore(key, out))
        except PipelineError as err:
            say(step.name, f"{remote.name}: refused {key[:16]}: {err}; building it here")
            return False
        if restored:
            took = time.monotonic() - started
            say(step.name, f"restored {key[:16]} from {remote.name} ({took:.2f} s)")
        return restored

    def output(self, step: Step) -> Path:
        """The stored output folder of a step that is done (store-backed steps)."""
        return self.store.output_dir(self.key(step))

    def run(self, step: Step) -> Path:
        """Produce the step's output (or find it done) and return its store folder."""
        key = self.key(step)
        dep_outputs = {dep.name: self.output(dep) for dep in step.deps}
        material = self.material(step)
        record = {"name": step.name, **material, "files": self._files[step.name]}
        started = time.monotonic()
        out, built = self.store.build(
            key,
            record,
            lambda out: step.action(StepRun(step, out, dep_outputs, material["params"], key)),
            self.cache(step),
        )
        took = time.monotonic() - started
        where = "" if step.cache is None else f" in {step.cache.name}"
        state = "built" if built else "found"
        say(step.name, f"{state} {key[:16]}{where} ({took:.2f} s)")
        if built and step.cache is None:
            self.upload(step, key)
        return out

    def upload(self, step: Step, key: str) -> None:
        """Share a store-backed step's new output through the remote cache, when writable.

        A failed upload is one line, not a failed step: the output stands here.
        """
        if self.remote is None or not self.remote.writable:
            return
        started = time.monotonic()
        folder = self.store.step_dir(key)
        try:
            record = read_record(folder / "step.json")
            self.remote.publish(key, folder, record)
        except PipelineError as err:
            say(step.name, f"not uploaded to {self.remote.name}: {err}")
            return
        took = time.monotonic() - started
        say(step.name, f"uploaded {key[:16]} to {self.remote.name} ({took:.2f} s)")

    def task(self, step: Step, variables: Sequence[str] = (), **extra: Any) -> dict[str, Any]:
        """The doit task dict of a step: staleness decided by its key, never by doit's MD5
        (variables: the doit `name=value` arguments it reads besides `profile`)."""
        GRAPH[step.name] = (self, step)
        return {
            **reading(variables),
            "basename": step.name,
            "doc": step.doc,
            "actions": [(self._doit_action, [step])],
            "uptodate": [lambda: self._uptodate(step)],
            "task_dep": [dep.name for dep in step.deps] + list(step.after),
            "verbosity": 2,
            **extra,
        }

    def _uptodate(self, step: Step) -> bool:
        try:
            done = self.is_done(step)
        except PipelineError:
            return False  # the action reports the error in one line
        if done:
            self.remember_found(step)
        return done

    def remember_found(self, step: Step) -> None:
        """Keep the record of output found done (built elsewhere: the registry, another
        runner), so that `explain` can later say what changed since."""
        key = self.key(step)
        if not self.store.has_record(step.name, key):
            now = time.time()
            record = {"name": step.name, **self.material(step), "files": self._files[step.name]}
            self.store.remember({**record, "key": key, "started": now, "finished": now})

    def _doit_action(self, step: Step) -> dict[str, str] | TaskFailed:
        failed = as_doit_action(lambda: self.run(step))()
        return failed or {"key": self.key(step)}


class StepFailed(TaskFailed):
    """doit's failed task, carrying the exit code of the error that failed it (read by the
    `run` command in pipelines/engine/run_command.py; pickled whole to doit's parent process)."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def as_doit_action(work: Callable[[], Any]) -> Callable[[], Any]:
    """A doit action that reports a failure as one line and a failed task (no traceback).

    Stages turn their services' errors into PipelineError; OSError is the disk's own.
    """

    def action() -> StepFailed | None:
        try:
            work()
        except PipelineError as err:
            return StepFailed(str(err), err.exit_code)
        except OSError as err:
            return StepFailed(f"{type(err).__name__}: {err}", PipelineError.exit_code)
        return None  # doit: the action succeeded

    return action


def side_task(
    name: str,
    doc: str,
    work: Callable[[], Any],
    uptodate: Callable[[], bool] | None = None,
    deps: Sequence[str] = (),
    variables: Sequence[str] = (),
) -> dict[str, Any]:
    """A doit task whose output lives outside the store (S3, blobs, a staged folder).

    Its uptodate check asks that place directly; without one the task runs when asked.
    variables: the doit `name=value` arguments it reads besides `profile` (`doit help`).
    """
    task = {
        "basename": name,
        "doc": doc,
        "actions": [as_doit_action(work)],
        "task_dep": list(deps),
        "verbosity": 2,
        **reading(variables),
    }
    if uptodate is not None:
        task["uptodate"] = [uptodate]
    return task
