"""Garbage collection with roots: `doit gc` frees what no deployment, build, tag or staged model
reaches. It sits above the stages: it reads deploy's records and the registry, and no stage,
engine or edge module imports it."""

from pipelines.gc.tasks import Gc

__all__ = ["Gc"]
