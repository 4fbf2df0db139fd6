"""The deploy stage as doit tasks: deploy (canary gate, then `:stable`), rollback, status."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any, Protocol

from pipelines.deploy.fielddiff import ObjectDiff, summary
from pipelines.deploy.health import smoke
from pipelines.deploy.plan import Deployment
from pipelines.deploy.preflight import provenance_problems
from pipelines.deploy.profilelock import in_turn, profile_lock
from pipelines.deploy.records import (
    DEPLOYED,
    REFUSED,
    RESTORED,
    ROLLED_BACK,
    UNCHANGED,
    CorruptDeploymentRecord,
    Records,
)
from pipelines.deploy.signals import restoring, terminate_as_interrupt
from pipelines.errors import ChangesPending, DeployError, Drift, PipelineError
from pipelines.progress import say, show
from pipelines.site import Site
from pipelines.stage import Context
from pipelines.steps import Step, side_task
from pipelines.targets import target_of
from pipelines.targets.kubeapi import KubeAccess
from pipelines.targets.pruning import Stray, prune_wanted, pruned_fields

if TYPE_CHECKING:
    from pipelines.deploy.backends import Backend
    from pipelines.images import PublishedImage
    from pipelines.weights import ModelOutputs

# Preflight's floor of free disk where a member keeps its model folder.
MIN_FREE_BYTES = 1 << 30


class Tags(Protocol):
    """What deploy needs of the images stage: moving `:stable`."""

    def promote(self, digest: str) -> str: ...
    def restore_stable(self, digest: str) -> str: ...
    def stable_digest(self) -> str | None: ...


@dataclass(frozen=True)
class DeploySettings:
    """What the edge tells the deploy stage."""

    site: Site  # the Docker engines by member (the local stack's), read on first use
    timeout_s: float  # how long a member may take to serve
    who: str  # the CI run or user, for the record
    git: Callable[[], str]  # the checkout's commit, for the record (asked when recording)
    kube: KubeAccess = KubeAccess()  # how the Kubernetes backend reaches its API server


@dataclass(frozen=True)
class RingStaging:
    """What staging needs from other stages: the stager image, the plan, where members keep
    their weights (published by the weights and images stages, asked for when it runs)."""

    image: Callable[[], str]  # the weights-stager image, pinned by digest
    plan: Callable[[], str]  # the ring plan, as `doit plan_weights` writes it
    roots: Callable[[], list[str]]  # each member's weights folder, by rank
    model_folder: Callable[[], str]  # the staged model's folder under a root: models/<key>
    after: tuple[str, ...] = ()  # the tasks that build the image


class Deploy:
    """Deploys one profile's rendered plans; publishes `live()`: the deployment that serves."""

    name = "deploy"

    def __init__(
        self,
        context: Context,
        *,
        render: Step,
        tags: Tags,
        model: ModelOutputs,
        stager: PublishedImage,
        provenance: Callable[[str], list[str]],
    ):
        profile, engine, settings = context.profile, context.engine, context.settings
        # One line per failed check of an image's attestation (pipelines/provenance/).
        self.provenance = provenance
        self.profile = profile
        # A ring stages its weights member to member, in the stager image (`doit stage_ring`
        # on Docker hosts; Jobs of the render on Kubernetes).
        self.ring_staging = (
            RingStaging(
                stager.ref,
                model.ring_plan_json,
                model.member_roots,
                model.model_folder,
                after=(*model.source_tasks, *stager.tasks),
            )
            if stager.wanted
            else None
        )
        self.engine = engine
        self.render = render
        self.tags = tags
        self.lock_file = model.lock_file
        # One line when the model's signature does not verify (pipelines/weights/signature.py).
        self.model_signature = model.signature_problems
        self.settings = DeploySettings(
            context.site,
            settings.deploy_timeout_s,
            context.who,
            context.git,
            KubeAccess(
                settings.kubeconfig,
                settings.kube_context,
                settings.kube_dry_run,
                stage_timeout_s=settings.stage_timeout_s,
            ),
        )
        deployments = engine.store.area("deployments")
        self.records = Records(deployments / profile.name)
        # `prune=no` keeps what a new render dropped (read once, like every setting).
        self.prune = prune_wanted(context.variable("prune"))
        self.deploy_lock = profile_lock(deployments, profile.name)

    @cached_property
    def backend(self) -> Backend:
        """The profile's backend, made on first use: `doit list` never imports one."""
        from pipelines.deploy.backends import backend_for

        settings = self.settings
        return backend_for(
            self.profile, settings.site.docker_hosts, settings.timeout_s, settings.kube
        )

    def candidate(self) -> Deployment:
        """The deployment `doit build` rendered last (its plans, keyed by their content)."""
        folder = self.engine.output(self.render)
        return self.backend.load(self._documents_key(), folder)

    def _documents_key(self) -> str:
        """The digest of the documents render wrote for the current inputs.

        Not the render step's key: that also covers the renderer's code and profile fields no
        document reads (bench, description), and a member restarts when its key changes.
        """
        digest, _ = self.engine.store.statcache.tree_listing(self.engine.output(self.render))
        return digest

    def _lock_sha256(self) -> str:
        """The sha256 of the profile's lock file."""
        return hashlib.sha256(self.lock_file.read_bytes()).hexdigest()

    def _record(self, deployment: Deployment, outcome: str, started: float, **extra: Any) -> None:
        lock_sha = self._lock_sha256()
        self.records.write(
            {
                "profile": self.profile.name,
                "outcome": outcome,
                "image": deployment.image,
                "lock_sha256": lock_sha,
                "git": self.settings.git(),
                "who": self.settings.who,
                "started": started,
                "finished": time.time(),
                "deployment": deployment.as_record(),
                **extra,
            }
        )

    def _roll_out(self, deployment: Deployment, started: float) -> list[Any]:
        """Apply, wait, smoke; on any failure (Ctrl-C, SIGTERM too) put the previous containers
        back."""
        served = self.profile.model.served_name
        changes: list[Any] = []  # the backend's own change records, handed back to restore
        try:
            changes = self.backend.apply(deployment)
            self.backend.wait(deployment, served)
            url = self.backend.endpoint(deployment)
            if url:
                text = smoke(url, served)
                say("deploy", f"smoke completion answered {text[:40]!r}")
        except BaseException as err:
            changes = changes or getattr(err, "changes", [])
            reason = str(err) if isinstance(err, PipelineError) else type(err).__name__
            with restoring():
                try:
                    self.backend.restore(changes, deployment.profile)
                except Exception as failed:  # the record must say so, whatever went wrong
                    self._record(
                        deployment, ROLLED_BACK, started, reason=reason, restore=str(failed)
                    )
                    raise DeployError(
                        f"deploy {deployment.profile}: {reason}; putting the previous deployment"
                        f" back failed: {failed}"
                    ) from None
                # Recorded before the wait: a kill while the old server loads loses nothing.
                self._record(deployment, ROLLED_BACK, started, reason=reason)
                self._wait_restored(served)
            if isinstance(err, PipelineError):
                raise DeployError(
                    f"deploy {deployment.profile}: {err}; the previous deployment was restored"
                ) from None
            raise
        self.backend.commit(changes)
        return changes

    def deploy(self) -> None:
        """Preflight every member, roll out, and only then move `:stable`."""
        started = time.time()
        self._dry_run_possible()
        deployment = self.candidate()
        refused = provenance_problems(self.provenance, deployment.image)
        refused += self.model_signature()
        if refused:
            self._record(deployment, REFUSED, started, reason=refused)
            raise DeployError("provenance refused, nothing touched: " + "; ".join(refused))
        hygiene = self.profile.hygiene
        problems = self.backend.preflight(
            deployment, bool(hygiene and hygiene.swap_off), MIN_FREE_BYTES, self._lock_sha256()
        )
        if problems:
            self._record(deployment, REFUSED, started, reason=problems)
            raise DeployError("preflight failed, nothing touched:\n" + "\n".join(problems))
        earlier = self._earlier()
        self._print_changes("deploy", deployment, earlier)
        if self.settings.kube.dry_run:
            self.backend.apply(deployment)  # every write with dryRun=All, no wait
            say("deploy", f"server dry run of {deployment.key[:16]}: nothing touched, no record")
            return
        changes = self._roll_out(deployment, started)
        pruned, not_pruned = self._prune(deployment, earlier)
        unchanged = all(change.unchanged for change in changes) and not pruned
        outcome = UNCHANGED if unchanged else DEPLOYED
        try:
            promoted = self.tags.promote(deployment.digest)
        except PipelineError as err:
            # The new deployment serves and the old one is gone: the record must say it is live.
            self._record(
                deployment,
                outcome,
                started,
                stable=f"not moved: {err}",
                **pruned_fields(pruned, not_pruned),
            )
            raise DeployError(
                f"deploy {deployment.profile}: {deployment.key[:16]} serves, but :stable was"
                f" not moved: {err}"
            ) from None
        self._record(
            deployment, outcome, started, stable=promoted, **pruned_fields(pruned, not_pruned)
        )
        self._prune_failed("deploy", deployment, not_pruned)
        state = "nothing restarted" if unchanged else "deployed"
        say("deploy", f"{state} {deployment.key[:16]}; {promoted}")
        url = self.backend.endpoint(deployment)
        if url:
            say("deploy", f"the service answers at {url}/v1")

    def _dry_run_possible(self) -> None:
        """A dry run is asked for only where the backend has one (the API server's)."""
        if self.settings.kube.dry_run and not self.backend.dry_run:
            raise DeployError(
                f"profile {self.profile.name}: a server dry run was asked for"
                f" (SPARKFORGE_KUBE_DRY_RUN) but deploy {self.profile.deploy!r} has none"
            )

    def rollback(self) -> None:
        """Restore the deployment before the live one, and `:stable` to the image it runs."""
        started = time.time()
        if self.settings.kube.dry_run:
            raise DeployError("rollback has no dry run; unset SPARKFORGE_KUBE_DRY_RUN")
        live = self.records.live()
        self.records.refuse_unread_after(live[-1]["time_ns"] if live else 0, "rollback")
        if not live:
            raise DeployError(f"profile {self.profile.name}: nothing deployed, nothing to restore")
        current = live[-1]["deployment"]["key"]
        earlier = [r for r in live if r["deployment"]["key"] != current]
        if not earlier:
            raise DeployError(f"profile {self.profile.name}: no earlier deployment to restore")
        # Checked before anything is touched: a record is hostile input.
        deployment = self._kept(earlier[-1])
        replaced = self._kept(live[-1])
        self._roll_out(deployment, started)
        # What the replaced deployment added goes too: the earlier one is restored as it was.
        pruned, not_pruned = self._prune(deployment, replaced)
        extra = pruned_fields(pruned, not_pruned)
        try:
            restored = self.tags.restore_stable(deployment.digest)
        except PipelineError as err:
            self._record(
                deployment, RESTORED, started, stable=f"not moved: {err}", replaced=current, **extra
            )
            raise DeployError(
                f"rollback {self.profile.name}: {deployment.key[:16]} serves again, but :stable"
                f" was not moved back: {err}"
            ) from None
        self._record(deployment, RESTORED, started, stable=restored, replaced=current, **extra)
        self._prune_failed("rollback", deployment, not_pruned)
        say("rollback", f"{deployment.key[:16]} restored; {restored}")

    def _kept(self, record: dict[str, Any]) -> Deployment:
        """The deployment a record kept, checked as its target applies it; else
        CorruptDeploymentRecord (exit 2) naming the record and the first bad field."""
        deployment = Deployment.from_record(self.profile.name, record["deployment"])
        problems = self.backend.validate(deployment)
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise CorruptDeploymentRecord(
                f"{self.records.folder / record['file']}: {problems[0]}{more}; nothing applied"
            )
        return deployment

    def _earlier(self) -> Deployment | None:
        """The deployment running now, as its record kept it (None: nothing deployed, or a
        record that cannot be used: said in one line; pruning then looks only where the new
        deployment runs)."""
        live = self.records.live()
        if not live:
            return None
        try:
            return self._kept(live[-1])
        except CorruptDeploymentRecord as err:
            self.records.skip(self.records.folder / live[-1]["file"], str(err))
            return None

    def _print_changes(
        self, action: str, deployment: Deployment, earlier: Deployment | None
    ) -> list[ObjectDiff]:
        """Print what deploying deployment would change (members or objects, field by field,
        and what pruning would delete); returns the changes that count."""
        diffs = self.backend.diff(deployment)
        strays = self.backend.strays(deployment, earlier)
        verb = "delete (prune)" if self.prune else "keep (prune=no)"
        listed = diffs + [ObjectDiff(stray.what, verb) for stray in strays]
        subject = f"{action}: {deployment.profile} {deployment.key[:16]} would change"
        for line in summary(listed, subject):
            show(line)
        return diffs + ([ObjectDiff(s.what, verb) for s in strays] if self.prune else [])

    def _prune(
        self, deployment: Deployment, earlier: Deployment | None
    ) -> tuple[list[Stray], list[str]]:
        """After a rollout: delete what the profile owns that deployment does not contain
        (unless prune=no); (what was deleted, one line per what could not be)."""
        if not self.prune:
            return [], []
        strays = self.backend.strays(deployment, earlier)
        failed = self.backend.prune(strays)
        gone = [s for s in strays if not any(line.startswith(s.what + ":") for line in failed)]
        for stray in gone:
            say("deploy", f"pruned {stray.what}")
        return gone, failed

    def _prune_failed(self, action: str, deployment: Deployment, failed: list[str]) -> None:
        """DeployError when pruning left something behind (the deployment serves)."""
        if failed:
            raise DeployError(
                f"{action} {deployment.profile}: {deployment.key[:16]} serves, but pruning"
                f" failed: {'; '.join(failed)}"
            )

    def diff(self) -> None:
        """Print what `doit deploy` would change; ChangesPending (exit 6) when anything."""
        deployment = self.candidate()
        changes = self._print_changes("diff", deployment, self._earlier())
        if changes:
            raise ChangesPending(
                f"diff {deployment.profile}: {len(changes)} member(s)/object(s) would change;"
                f" `doit deploy profile={deployment.profile}` applies them"
            )

    def _wait_restored(self, served: str) -> None:
        """Wait for the deployment put back to serve again (a restarted server takes a moment)."""
        live = self.records.live()
        if not live:
            return
        previous = Deployment.from_record(self.profile.name, live[-1]["deployment"])
        try:
            self.backend.wait(previous, served)
        except PipelineError as err:
            say("deploy", f"the restored deployment does not serve yet: {err}")

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
        return {**last, "endpoint": self.backend.endpoint(deployment)}

    def status(self) -> None:
        """What is deployed, whether it runs, and whether it is what `doit build` makes now."""
        live = self.records.live()
        if not live:
            say("status", f"nothing deployed for {self.profile.name}")
            return
        last = live[-1]
        deployment = self._kept(last)
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(last["finished"]))
        say("status", f"{self.profile.name}: {last['outcome']} {when} by {last['who']}")
        show(f"  deployment {deployment.key}")
        show(f"  image {deployment.image}")
        show(f"  lock sha256 {last['lock_sha256']}, git {last['git']}")
        show(f"  :stable at {self._stable_now()}")
        for line in self.backend.running(deployment):
            show(f"  {line}")
        show(f"  doit build now: {self._build_now(deployment)}")
        drift = self.backend.drift(deployment)
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
            now = self._documents_key()
        except PipelineError as err:
            return f"cannot tell ({err})"
        return "matches" if now == deployment.key else f"differs (would deploy {now[:16]})"

    def stage_ring(self) -> None:
        """Stage the weights on every member of a Docker-host ring: one container per host,
        each member's share from S3, the rest from its peers, every file verified."""
        import os

        from pipelines.deploy.dockerhosts import DockerHosts
        from pipelines.deploy.ringstage import Stagers, s3_environment
        from pipelines.targets.dockerengines import MemberHost

        staging, hosts = self.ring_staging, self.backend
        # The task exists only where the target stages by containers on Docker hosts.
        assert staging is not None and isinstance(hosts, DockerHosts)
        env = s3_environment(os.environ)
        image, plan = staging.image(), staging.plan()
        members = [
            MemberHost(rank, m.node, url)
            for rank, (m, url) in enumerate(zip(self.profile.members, hosts.engines(), strict=True))
        ]
        started = time.monotonic()
        Stagers(hosts, self.profile.name).run(
            members, image, plan, staging.roots(), staging.model_folder(), env
        )
        took = time.monotonic() - started
        say("stage_ring", f"{len(members)} members staged and verified in {took:.1f} s")

    def _backend_built(self, work: Callable[[], None]) -> Callable[[], None]:
        """work, with the profile's backend made first (every target has one) and closed after;
        SIGTERM stops it as Ctrl-C does."""

        def run() -> None:
            backend = self.backend
            try:
                with terminate_as_interrupt():
                    work()
            finally:
                backend.close()

        return run

    def _in_turn(self, action: str, work: Callable[[], None]) -> Callable[[], None]:
        """work, once no other deploy, rollback or ring staging of the profile runs from this
        store: two would put aside each other's containers and interleave their records."""

        def run() -> None:
            with in_turn(self.deploy_lock, self.profile.name, action, self.settings.who):
                work()

        return run

    def create_doit_tasks(self) -> Iterator[dict[str, Any]]:
        """deploy (after build), stage_ring (Docker-host rings), rollback and status."""
        yield side_task(
            "deploy",
            "deploy the built profile, smoke it, then move :stable (restores on failure)",
            self._backend_built(self._in_turn("deploy", self.deploy)),
            deps=["build"],
        )
        if self.ring_staging and not target_of(self.profile).stages_in_render:
            yield side_task(
                "stage_ring",
                "stage the weights on every member host: each file from S3 once, the rest"
                " from peers (weights-stager containers)",
                self._backend_built(self._in_turn("stage_ring", self.stage_ring)),
                deps=list(self.ring_staging.after),
            )
        yield side_task(
            "rollback",
            "restore the previous deployment and point :stable at its image",
            self._backend_built(self._in_turn("rollback", self.rollback)),
        )
        yield side_task(
            "status",
            "print what is deployed, whether doit build matches it, and drift (exit 7)",
            self._backend_built(self.status),
        )
        yield side_task(
            "diff",
            "print what doit deploy would change, field by field (exit 6 when anything)",
            self._backend_built(self.diff),
            deps=[self.render.name],
        )
