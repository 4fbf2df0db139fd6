"""The fabric stage as a doit task: run the rendered probe on the ring, check, keep the result."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipelines.core.errors import PipelineError
from pipelines.core.files import MiB
from pipelines.core.profiles import Profile
from pipelines.core.progress import say
from pipelines.core.schema import load_yaml_documents
from pipelines.engine.stage import Context
from pipelines.engine.steps import Step, side_task
from pipelines.stages.fabric.records import FAILED, PASSED, fabric_refusal, write_result
from pipelines.stages.fabric.settings import FabricSettings
from pipelines.targets import load, target_of
from pipelines.targets.kubeapi import KubeAccess
from pipelines.targets.pruning import Stray, prune_wanted, pruned_fields

if TYPE_CHECKING:  # the parser and the checks are imported when a check runs, not at `doit list`
    from pipelines.stages.fabric.expect import Expectations
    from pipelines.stages.fabric.launch import Launcher, MemberRun
    from pipelines.stages.fabric.nccllog import NcclLog


# The fabric documents a render writes are a few KiB each; a file past this is not one of them.
DOCUMENTS_MAX_BYTES = 16 * MiB


class FabricDocumentsError(PipelineError):
    """A fabric document that cannot be read (render output changed or broken in the store)."""


def fabric_documents(folder: Path) -> list[dict[str, Any]]:
    """The fabric documents render wrote (`fabric-*.yaml`), ConfigMap first, then by rank."""
    docs = []
    for path in sorted(folder.glob("fabric-*.yaml")):
        bodies = load_yaml_documents(path, FabricDocumentsError, DOCUMENTS_MAX_BYTES)
        docs += [body for body in bodies if body]
    return sorted(docs, key=lambda d: (d.get("kind") != "ConfigMap", d.get("rank", 0)))


def default_launcher(profile: Profile, settings: FabricSettings) -> Launcher:
    """The launch the runtime uses, as the profile's target names it (pipelines/targets/)."""
    launcher: Launcher = load(target_of(profile).launcher)(profile, settings)
    return launcher


def summary(log: NcclLog) -> dict[str, Any]:
    """What was measured, with stable key names (busbw in GB/s, sizes in bytes)."""
    counts: dict[str, int] = {}
    for channel in log.channels:
        counts[channel.transport] = counts.get(channel.transport, 0) + 1
    largest = log.largest
    return {
        "transports": dict(sorted(counts.items())),
        "largest": asdict(largest) if largest else None,
        "results": [asdict(r) for r in log.results],
        "avg_busbw": log.avg_busbw,
        "hcas_listed": {h: sorted(d.values()) for h, d in sorted(log.ib_devices.items())},
        "hcas_used": sorted(log.hcas_used()),
        "nccl_versions": sorted(log.versions),
        "errors": log.errors[:20],
    }


class Fabric:
    """The fabric check of a ring profile (none for a profile without a fabric section);
    publishes `refusal`: why the bench must not start yet."""

    name = "fabric"

    def __init__(
        self,
        context: Context,
        *,
        render: Step,
        live: Callable[[], dict[str, Any] | None],
    ):
        settings = context.settings
        self.profile = context.profile
        self.engine = context.engine
        self.render = render
        self.live = live  # deploy's published live deployment record
        self.settings = FabricSettings(
            context.site,
            context.who,
            context.git,
            KubeAccess(settings.kubeconfig, settings.kube_context),
            expect=context.variable("expect"),  # `doit fabric expect=P2P>=200`: a hand check
            prune=prune_wanted(context.variable("prune")),
        )

    @property
    def refusal(self) -> Callable[[], str | None] | None:
        """Why the bench must not start (one line, or None when it may); None: no fabric."""
        store, name, live = self.engine.store, self.profile.name, self.live
        return (lambda: fabric_refusal(store, name, live())) if self.profile.fabric else None

    def expectations(self) -> Expectations:
        """The hand-given expectation, else the profile's."""
        from pipelines.stages.fabric.expect import expectations_for, parse_expectation

        if self.settings.expect:
            return parse_expectation(self.settings.expect)
        return expectations_for(self.profile)

    def check(self) -> Path:
        """Run, parse, check, keep one result; FabricError with one line per failure."""
        from pipelines.stages.fabric.expect import FabricError, failures
        from pipelines.stages.fabric.nccllog import NcclLog, add_log

        expect = self.expectations()
        key = self.engine.key(self.render)
        docs = fabric_documents(self.engine.output(self.render))
        if not docs:
            raise FabricError(
                f"profile {self.profile.name}: render wrote no fabric-*.yaml documents; expected"
                " the fabric check's Jobs or launch plans"
            )
        launcher = (self.settings.launcher or default_launcher)(self.profile, self.settings)
        started = time.time()
        try:
            runs = launcher.run(docs, self.settings.timeout_s)
            pruned, not_pruned = self.prune(launcher, docs)
        finally:
            getattr(launcher, "close", lambda: None)()
        log = NcclLog()
        for run in runs:
            add_log(log, run.log, run.node)
        lines = failures(log, expect)
        for run in runs:
            if run.status is None:
                lines.append(f"member {run.node}: did not finish in {self.settings.timeout_s:g} s")
            elif run.status != 0:
                lines.append(f"member {run.node}: the probe exited with status {run.status}")
        images = sorted({i for d in docs if (i := d.get("image") or image_of(d)) is not None})
        measured_now = summary(log)
        result: dict[str, Any] = {
            "profile": self.profile.name,
            "outcome": FAILED if lines else PASSED,
            "image": images[0] if len(images) == 1 else images,
            "render_key": key,
            "members": [
                {"rank": r.rank, "node": r.node, "status": r.status, "address": address(self, r)}
                for r in runs
            ],
            "expectations": asdict(expect),
            "measured": measured_now,
            "failures": lines,
            "git": self.settings.git(),
            "who": self.settings.who,
            "started": started,
            "finished": time.time(),
            **pruned_fields(pruned, not_pruned),
        }
        path = write_result(self.engine.store, result, {r.rank: r.log for r in runs})
        largest = log.largest
        measured = f"{largest.busbw:.2f} GB/s at {largest.size} bytes" if largest else "no busbw"
        transports = ", ".join(f"{k} x{v}" for k, v in measured_now["transports"].items())
        say("fabric", f"{self.profile.name}: {transports or 'no channels'}; {measured}")
        say("fabric", f"result {path}")
        if lines or not_pruned:
            pruning = [f"pruning failed: {line}" for line in not_pruned]
            raise FabricError("\n".join(f"fabric: {line}" for line in lines + pruning))
        say("fabric", f"{self.profile.name}: passed ({expect.transport})")
        return path

    def prune(
        self, launcher: Launcher, docs: list[dict[str, Any]]
    ) -> tuple[list[Stray], list[str]]:
        """After a run: delete what the profile's fabric checks applied that this render lacks
        (unless prune=no); (what was deleted, one line per what could not be)."""
        from pipelines.stages.fabric.expect import FabricError

        try:
            strays = launcher.strays(docs)
        except FabricError as err:  # the run's measurements are kept all the same
            return [], [f"listing what to prune: {err}"]
        if not self.settings.prune:
            for stray in strays:
                say("fabric", f"kept (prune=no) {stray.what}")
            return [], []
        failed = launcher.prune(strays)
        gone = [s for s in strays if not any(line.startswith(s.what + ":") for line in failed)]
        for stray in gone:
            say("fabric", f"pruned {stray.what}")
        return gone, failed

    def create_doit_tasks(self) -> Iterator[dict[str, Any]] | None:
        """fabric: the all-reduce on the ring, after render; none without a fabric section."""
        return self._tasks() if self.profile.fabric else None

    def _tasks(self) -> Iterator[dict[str, Any]]:
        """The fabric task."""
        yield side_task(
            "fabric",
            "all-reduce across the ring as the runtime launches it; check transport, busbw, HCAs",
            self.check,
            deps=["render"],
            variables=("expect", "prune", "image_digest"),
        )


def image_of(doc: dict[str, Any]) -> str | None:
    """The image of a Job document."""
    containers = doc.get("spec", {}).get("template", {}).get("spec", {}).get("containers", [])
    return containers[0].get("image") if containers else None


def address(stage: Fabric, run: MemberRun) -> str:
    """The management address of a member, from the profile."""
    return str(stage.profile.members[run.rank].address)
