"""The deploy stage as doit tasks: deploy (canary gate, then `:stable`), rollback, status."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

from pipelines.core.errors import DeployError, PipelineError
from pipelines.core.progress import say
from pipelines.core.site import Site
from pipelines.engine.stage import Context
from pipelines.engine.steps import Step, side_task
from pipelines.stages.deploy.deployed import Deployed, Tags
from pipelines.stages.deploy.health import smoke
from pipelines.stages.deploy.plan import Deployment
from pipelines.stages.deploy.preflight import provenance_problems
from pipelines.stages.deploy.profilelock import in_turn, profile_lock
from pipelines.stages.deploy.records import (
    DEPLOYED,
    REFUSED,
    RESTORED,
    ROLLED_BACK,
    UNCHANGED,
    Records,
)
from pipelines.stages.deploy.ringstage import RingStaging
from pipelines.stages.deploy.signals import restoring, terminate_as_interrupt
from pipelines.targets import target_of
from pipelines.targets.kubeapi import KubeAccess
from pipelines.targets.pruning import Stray, prune_wanted, pruned_fields

if TYPE_CHECKING:
    from pipelines.engine.published import PublishedImage, PublishedModel
    from pipelines.stages.deploy.backends import Backend

# Preflight's floor of free disk where a member keeps its model folder.
MIN_FREE_BYTES = 1 << 30


@dataclass(frozen=True)
class DeploySettings:
    """What the edge tells the deploy stage."""

    site: Site  # the Docker engines by member (the local stack's), read on first use
    timeout_s: float  # how long a member may take to serve
    who: str  # the CI run or user, for the record
    git: Callable[[], str]  # the checkout's commit, for the record (asked when recording)
    kube: KubeAccess = KubeAccess()  # how the Kubernetes backend reaches its API server


def prune_strays(
    backend: Backend, deployment: Deployment, earlier: Deployment | None, wanted: bool
) -> tuple[list[Stray], list[str]]:
    """After a rollout: delete what the profile owns that deployment does not contain (unless
    prune=no); (what was deleted, one line per what could not be)."""
    if not wanted:
        return [], []
    strays = backend.strays(deployment, earlier)
    failed = backend.prune(strays)
    gone = [s for s in strays if not any(line.startswith(s.what + ":") for line in failed)]
    for stray in gone:
        say("deploy", f"pruned {stray.what}")
    return gone, failed


def refuse_unpruned(action: str, deployment: Deployment, failed: list[str]) -> None:
    """DeployError when pruning left something behind (the deployment serves)."""
    if failed:
        raise DeployError(
            f"{action} {deployment.profile}: {deployment.key[:16]} serves, but pruning"
            f" failed: {'; '.join(failed)}"
        )


class Deploy:
    """Deploys one profile's rendered plans; publishes `live()`: the deployment that serves."""

    name = "deploy"

    def __init__(
        self,
        context: Context,
        *,
        render: Step,
        tags: Tags,
        model: PublishedModel,
        stager: PublishedImage,
        provenance: Callable[[str], list[str]],
    ):
        profile, engine, settings = context.profile, context.engine, context.settings
        # One line per failed check of an image's attestation (pipelines/stages/provenance/).
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
        # One line when the model's signature does not verify (stages/weights/signature.py).
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
        self.deployed = Deployed(
            profile, engine, render, self.records, tags, lambda: self.backend, self.prune
        )
        # Published: the deployment that serves (the fabric check's and the bench's).
        self.live_record = self.deployed.live_record
        self.live = self.deployed.live

    @cached_property
    def backend(self) -> Backend:
        """The profile's backend, made on first use: `doit list` never imports one."""
        from pipelines.stages.deploy.backends import backend_for

        settings = self.settings
        return backend_for(
            self.profile, settings.site.docker_hosts, settings.timeout_s, settings.kube
        )

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
                self.deployed.wait_restored(served)
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
        deployment = self.deployed.candidate()
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
        earlier = self.deployed.earlier()
        self.deployed.print_changes("deploy", deployment, earlier)
        if self.settings.kube.dry_run:
            self.backend.apply(deployment)  # every write with dryRun=All, no wait
            say("deploy", f"server dry run of {deployment.key[:16]}: nothing touched, no record")
            return
        changes = self._roll_out(deployment, started)
        pruned, not_pruned = prune_strays(self.backend, deployment, earlier, self.prune)
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
        refuse_unpruned("deploy", deployment, not_pruned)
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
        deployment = self.deployed.kept(earlier[-1])
        replaced = self.deployed.kept(live[-1])
        self._roll_out(deployment, started)
        # What the replaced deployment added goes too: the earlier one is restored as it was.
        pruned, not_pruned = prune_strays(self.backend, deployment, replaced, self.prune)
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
        refuse_unpruned("rollback", deployment, not_pruned)
        say("rollback", f"{deployment.key[:16]} restored; {restored}")

    def _stage_ring(self) -> None:
        """Stage the weights on every member host (ringstage.stage_ring)."""
        from pipelines.stages.deploy.ringstage import stage_ring

        assert self.ring_staging is not None  # the task exists only for a ring that stages
        stage_ring(self.profile, self.ring_staging, self.backend)

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
            variables=("image_digest", "stager_digest", "prune"),
        )
        if self.ring_staging and not target_of(self.profile).stages_in_render:
            yield side_task(
                "stage_ring",
                "stage the weights on every member host: each file from S3 once, the rest"
                " from peers (weights-stager containers)",
                self._backend_built(self._in_turn("stage_ring", self._stage_ring)),
                deps=list(self.ring_staging.after),
                variables=("stager_digest",),
            )
        yield side_task(
            "rollback",
            "restore the previous deployment and point :stable at its image",
            self._backend_built(self._in_turn("rollback", self.rollback)),
            variables=("prune",),
        )
        yield side_task(
            "status",
            "print what is deployed, whether doit build matches it, and drift (exit 7)",
            self._backend_built(self.deployed.status),
            variables=("image_digest", "stager_digest"),
        )
        yield side_task(
            "diff",
            "print what doit deploy would change, field by field (exit 6 when anything)",
            self._backend_built(self.deployed.diff),
            deps=[self.render.name],
            variables=("image_digest", "stager_digest", "prune"),
        )
