"""What is deployed for one profile, read and compared: its records, the candidate `doit
build` rendered, `doit status` and `doit diff`. The deploy stage writes; this side only reads."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from pipelines.core.errors import ChangesPending, Drift, PipelineError
from pipelines.core.progress import say, show
from pipelines.engine.steps import Engine, Step
from pipelines.stages.deploy.fielddiff import ObjectDiff, summary
from pipelines.stages.deploy.plan import Deployment
from pipelines.stages.deploy.records import CorruptDeploymentRecord, Records

if TYPE_CHECKING:
    from pipelines.core.profiles import Profile
    from pipelines.stages.deploy.backends import Backend


class Tags(Protocol):
    """What deploy needs of the images stage: moving `:stable`."""

    def promote(self, digest: str) -> str: ...
    def restore_stable(self, digest: str) -> str: ...
    def stable_digest(self) -> str | None: ...


class Deployed:
    """One profile's deployments as recorded and as its backend finds them."""

    def __init__(
        self,
        profile: Profile,
        engine: Engine,
        render: Step,
        records: Records,
        tags: Tags,
        backend: Callable[[], Backend],
        prune: bool,
    ):
        self.profile = profile
        self.engine = engine
        self.render = render
        self.records = records
        self.tags = tags
        self.backend = backend  # the deploy's, made on first use
        self.prune = prune

    def candidate(self) -> Deployment:
        """The deployment `doit build` rendered last (its plans, keyed by their content)."""
        folder = self.engine.output(self.render)
        return self.backend().load(self.documents_key(), folder)

    def documents_key(self) -> str:
        """The digest of the documents render wrote for the current inputs.

        Not the render step's key: that also covers the renderer's code and profile fields no
        document reads (bench, description), and a member restarts when its key changes.
        """
        digest, _ = self.engine.store.statcache.tree_listing(self.engine.output(self.render))
        return digest

    def kept(self, record: dict[str, Any]) -> Deployment:
        """The deployment a record kept, checked as its target applies it; else
        CorruptDeploymentRecord (exit 2) naming the record and the first bad field."""
        deployment = Deployment.from_record(self.profile.name, record["deployment"])
        problems = self.backend().validate(deployment)
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise CorruptDeploymentRecord(
                f"{self.records.folder / record['file']}: {problems[0]}{more}; nothing applied"
            )
        return deployment

    def earlier(self) -> Deployment | None:
        """The deployment running now, as its record kept it (None: nothing deployed, or a
        record that cannot be used: said in one line; pruning then looks only where the new
        deployment runs)."""
        live = self.records.live()
        if not live:
            return None
        try:
            return self.kept(live[-1])
        except CorruptDeploymentRecord as err:
            self.records.skip(self.records.folder / live[-1]["file"], str(err))
            return None

    def print_changes(
        self, action: str, deployment: Deployment, earlier: Deployment | None
    ) -> list[ObjectDiff]:
        """Print what deploying deployment would change (members or objects, field by field,
        and what pruning would delete); returns the changes that count."""
        diffs = self.backend().diff(deployment)
        strays = self.backend().strays(deployment, earlier)
        verb = "delete (prune)" if self.prune else "keep (prune=no)"
        listed = diffs + [ObjectDiff(stray.what, verb) for stray in strays]
        subject = f"{action}: {deployment.profile} {deployment.key[:16]} would change"
        for line in summary(listed, subject):
            show(line)
        return diffs + ([ObjectDiff(s.what, verb) for s in strays] if self.prune else [])

    def diff(self) -> None:
        """Print what `doit deploy` would change; ChangesPending (exit 6) when anything."""
        deployment = self.candidate()
        changes = self.print_changes("diff", deployment, self.earlier())
        if changes:
            raise ChangesPending(
                f"diff {deployment.profile}: {len(changes)} member(s)/object(s) would change;"
                f" `doit deploy profile={deployment.profile}` applies them"
            )

    def live_record(self) -> dict[str, Any] | None:
        """The record of the deployment running now, `time_ns` its time (None: none).

        Published for the fabric stage: a check older than it, or of other documents, is stale.
        """
        live = self.records.live()
        return live[-1] if live else None

    def live(self) -> dict[str, Any] | None:
        """The deployment running now, as its record plus `endpoint` (None: nothing deployed).

        Published for the bench: what it measures, and the provenance its results carry.
        """
        live = self.records.live()
        if not live:
            return None
        last = live[-1]
        deployment = Deployment.from_record(self.profile.name, last["deployment"])
        return {**last, "endpoint": self.backend().endpoint(deployment)}

    def status(self) -> None:
        """What is deployed, whether it runs, and whether it is what `doit build` makes now."""
        live = self.records.live()
        if not live:
            say("status", f"nothing deployed for {self.profile.name}")
            return
        last = live[-1]
        deployment = self.kept(last)
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(last["finished"]))
        say("status", f"{self.profile.name}: {last['outcome']} {when} by {last['who']}")
        show(f"  deployment {deployment.key}")
        show(f"  image {deployment.image}")
        show(f"  lock sha256 {last['lock_sha256']}, git {last['git']}")
        show(f"  :stable at {self._stable_now()}")
        for line in self.backend().running(deployment):
            show(f"  {line}")
        show(f"  doit build now: {self._build_now(deployment)}")
        drift = self.backend().drift(deployment)
        for line in summary(drift, "drift since deployed"):
            show(f"  {line}")
        if drift:
            raise Drift(
                f"status {self.profile.name}: {len(drift)} member(s)/object(s) changed since"
                f" deployment {deployment.key[:16]} applied them (drift)"
            )

    def _stable_now(self) -> str:
        """Where `:stable` points, or why that cannot be told (a registry down must not hide
        drift from a scheduled status)."""
        try:
            return str(self.tags.stable_digest())
        except PipelineError as err:
            return f"cannot tell ({err})"

    def _build_now(self, deployment: Deployment) -> str:
        """Whether what `doit build` renders now is the deployed documents."""
        try:
            if not self.engine.is_done(self.render):
                return "differs (not rendered yet)"
            now = self.documents_key()
        except PipelineError as err:
            return f"cannot tell ({err})"
        return "matches" if now == deployment.key else f"differs (would deploy {now[:16]})"

    def wait_restored(self, served: str) -> None:
        """Wait for the deployment put back to serve again (a restarted server takes a moment)."""
        live = self.records.live()
        if not live:
            return
        previous = Deployment.from_record(self.profile.name, live[-1]["deployment"])
        try:
            self.backend().wait(previous, served)
        except PipelineError as err:
            say("deploy", f"the restored deployment does not serve yet: {err}")
