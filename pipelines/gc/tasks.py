"""`doit gc`: what the store holds that no root reaches, said (dry run) or deleted (--delete);
and the build log `doit build` leaves for it."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from functools import cache
from typing import TYPE_CHECKING, Any

from pipelines.core.errors import PipelineError
from pipelines.core.paths import PROFILES_DIR
from pipelines.core.progress import say, show
from pipelines.engine.gcplan import Item, Roots, gc_plan, kept_step_keys, report
from pipelines.engine.stage import Context
from pipelines.engine.steps import GRAPH, as_doit_action
from pipelines.gc.builds import log_build, profile_builds, write_roots
from pipelines.gc.checkout import Checkout
from pipelines.gc.collect import collect
from pipelines.gc.inventory import store_items
from pipelines.gc.roots import gather_roots
from pipelines.gc.tags import (
    delete_tags,
    first_seen,
    read_ledger,
    tag_items,
    tag_roots,
    tagged_digests,
    write_ledger,
)
from pipelines.stages.images.registry import Registry

if TYPE_CHECKING:
    from pipelines.engine.published import PublishedImage


class Gc:
    """Garbage collection of the store with roots; publishes `log_build` and `build_logged`
    (the build task's action and uptodate check: the build log)."""

    name = "gc"

    def __init__(self, context: Context, *, image: PublishedImage, repository: Callable[[], str]):
        self.profile = context.profile.name
        self.engine = context.engine
        self.store = context.engine.store
        # The model blobs: where the weights stage keeps them (SPARKFORGE_WEIGHTS, or the store's).
        self.weights = context.settings.weights or self.store.root / "weights"
        self.keep_builds = context.settings.gc_keep_builds
        self.tag_days = context.settings.gc_tag_days
        # The profiles whose model folders and locks stay: the checkout's, and a lab's own.
        self.checkout = Checkout(profiles=(PROFILES_DIR, context.settings.profiles))
        self.image = image
        # The profile's image repository: where gc collects candidate-* and key-* tags.
        self.repository = repository
        site = context.site
        self.registry = Registry(lambda: site.registry)
        self._built: tuple[dict[str, str], list[str]] | None = None
        # What `doit build` runs last: the build log gc takes its build roots from.
        self.log_build = as_doit_action(self._log_build)

    def _log_build(self) -> None:
        """Record the keys of this run's steps that are done, and the profile's image."""
        steps, images = self._build()
        log_build(self.store.area("builds"), self.profile, steps, images)

    def build_logged(self) -> bool:
        """True when the newest build logged is this one (same keys, same image): a no-op
        build logs nothing, so it neither runs a task nor pushes other builds out of the N."""
        try:
            steps, images = self._build()
        except PipelineError:
            return False
        newest = profile_builds(self.store.root / "builds" / self.profile, 1)
        return bool(newest) and (newest[0]["steps"], newest[0].get("images", [])) == (steps, images)

    def _build(self) -> tuple[dict[str, str], list[str]]:
        """(step name -> key of each step of this run that is done, the profile's image),
        found once per run (after the build's tasks: doit asks uptodate, then the action)."""
        if self._built is None:
            self._built = self._find_build()
        return self._built

    def _find_build(self) -> tuple[dict[str, str], list[str]]:
        steps = {}
        for engine, step in list(GRAPH.values()):
            if engine is not self.engine:
                continue
            try:
                key = engine.key(step)
                if step.cache is not None or self.store.has(key):
                    steps[step.name] = key
            except PipelineError:
                continue  # not part of this build (a step it never asked for)
        try:
            images = [self.image.ref()] if self.image.wanted else []
        except PipelineError as err:
            say("build", f"the image is not in the build log ({err})")
            images = []
        return steps, images

    def collect(self, delete: bool) -> None:
        """Say what each item is and why; with delete, free what no root reaches."""
        store = self.store
        alone = store.alone("gc") if delete else contextlib.nullcontext()
        with alone:
            items = store_items(store, self.weights)
            building = [i.refs[0].split(":", 1)[1] for i in items if i.kind == "tmp" and i.refs]
            roots = gather_roots(
                store, self.weights, self.keep_builds, building, registry_at, self.checkout
            )
            tags, reach, repository = self.tags(roots)
            verdicts = gc_plan(items + tags, Roots({**roots.reach, **reach}, roots.unknown))
            for line in report(verdicts, delete):
                say("gc", line)
            written = write_roots(store.area("gc"), kept_step_keys(verdicts, roots))
            show(
                f"gc: the step keys its roots reach: {written}"
                " (for `python -m pipelines.engine.remote gc --roots`)"
            )
            if delete:
                collect(store, self.weights, verdicts)
                if repository:
                    delete_tags(self.registry, repository, verdicts)
            else:
                say("gc", "dry run, nothing deleted; `doit gc --delete` deletes what it would free")

    def tags(self, roots: Roots) -> tuple[list[Item], dict[str, str], str | None]:
        """(tag items, their roots, the repository) of the profile's image repository; none,
        said in one line, when the registry cannot be asked. Keeps the first-seen ledger."""
        try:
            repository = self.repository()
            tagged = tagged_digests(self.registry, repository)
            where = f"{self.registry.host}/{repository}"
        except PipelineError as err:
            say("gc", f"registry tags not collected ({err})")
            return [], {}, None
        ledger = self.store.area("gc") / "tags-seen.json"
        now = time.time()
        seen = read_ledger(ledger)
        write_ledger(ledger, first_seen(seen, repository, tagged, now))
        kept = {
            ref.split("@")[1]: why
            for ref, why in roots.images.items()
            if ref.split("@")[0] == where
        }
        reach = tag_roots(repository, tagged, kept, seen, now, self.tag_days)
        return tag_items(repository, tagged), reach, repository

    def create_doit_tasks(self) -> Iterator[dict[str, Any]]:
        """The gc task (dry run unless --delete)."""
        yield {
            "basename": "gc",
            "doc": "say what the store holds that no root reaches (--delete: free it)",
            "actions": [(self._gc_action,)],
            "params": [
                {
                    "name": "delete",
                    "long": "delete",
                    "type": bool,
                    "default": False,
                    "help": "delete what no root reaches (default: a dry run)",
                }
            ],
            "verbosity": 2,
        }

    def _gc_action(self, delete: bool) -> Any:
        return as_doit_action(lambda: self.collect(delete))()


@cache
def registry_at(host: str) -> Registry:
    """One registry client per host a kept image names."""
    return Registry(host)
