"""The bench stage as a doit task: measure the live deployment, report, gate on the baseline."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipelines.core.errors import BadInput
from pipelines.core.progress import show
from pipelines.engine.stage import Context
from pipelines.engine.steps import side_task
from pipelines.stages.bench.failures import (
    BenchError,
    BenchInconclusive,
    BenchRegression,
    NotMeasured,
)
from pipelines.stages.bench.gate import measured_all, regressed

HISTORY_DEPLOYMENTS = 10  # deployments on the history plot


def failure_of(results: dict[str, Any], baseline: list[Any]) -> type[BenchError]:
    """What a failed run says to CI: measured nothing sure (3), a regression (4), else 1."""
    if not measured_all(results, baseline):
        return NotMeasured
    return BenchRegression if regressed(results, baseline) else BenchError


def outcome(
    results: dict[str, Any], baseline: list[Any], name: str, report: Path
) -> BenchError | None:
    """The error a gated run ends with (its exit code what CI acts on), None when it passed:
    failures first (regressed 4, unmeasured 3, else 1), then what the gate cannot decide (5)."""
    if results["failures"]:
        lines = "\n".join(f"  {f}" for f in results["failures"])
        failure = failure_of(results, baseline)
        return failure(f"bench {name} failed (report {report}):\n{lines}")
    if results["inconclusive"]:
        lines = "\n".join(f"  {f}" for f in results["inconclusive"])
        return BenchInconclusive(
            f"bench {name} inconclusive (report {report}): nothing regressed for sure, but:"
            f"\n{lines}"
        )
    return None


@dataclass(frozen=True)
class BenchSettings:
    """What the edge tells the bench: the live deployment, the fabric's word, the checkout."""

    deployment: Callable[[], dict[str, Any] | None]  # deploy's published `live()`
    fabric_refusal: Callable[[], str | None] | None = None  # None: the profile has no fabric
    git: Callable[[], str] = lambda: "unknown"
    endpoint: str = ""  # SPARKFORGE_BENCH_URL: overrides the profile's and the deployment's


class Bench:
    """The benchmark of one profile's live endpoint; publishes `run()` -> the report's path."""

    name = "bench"

    def __init__(
        self,
        context: Context,
        *,
        live: Callable[[], dict[str, Any] | None],
        fabric_refusal: Callable[[], str | None] | None,
    ):
        # live: deploy's published deployment; fabric_refusal: the fabric check's word (None:
        # the profile has no fabric).
        self.profile = context.profile
        self.engine = context.engine
        self.settings = BenchSettings(live, fabric_refusal, context.git, context.settings.bench_url)

    def provenance(self, deployed: dict[str, Any], endpoint: str) -> dict[str, Any]:
        """Where the numbers come from: the deployment's record and this checkout."""
        started = time.time()
        return {
            "profile": self.profile.name,
            "endpoint": endpoint,
            "model": self.profile.model.served_name,
            "image": deployed.get("image"),
            "lock_sha256": deployed.get("lock_sha256"),
            "manifests_key": (deployed.get("deployment") or {}).get("key"),
            "deployed_git": deployed.get("git"),
            "deployed_at": deployed.get("finished"),
            "git": self.settings.git(),
            "started": started,
            "started_iso": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(started)),
        }

    def endpoint(self, deployed: dict[str, Any]) -> str:
        """The URL to measure: the environment's, the profile's, else the deployment's."""
        url = self.settings.endpoint or self.profile.bench.endpoint or deployed.get("endpoint")
        if not url:
            raise BadInput(
                f"profile {self.profile.name}: no endpoint to measure; set bench.endpoint in the"
                " profile or SPARKFORGE_BENCH_URL"
            )
        return url.rstrip("/")

    def run(self) -> Path:
        """Probe, sweep, saturate, ask needles; write results, report, plots; gate."""
        from pipelines.stages.bench.report import decode_table, write_results
        from pipelines.stages.bench.run import gate, run_bench, say

        deployed = self.settings.deployment()
        if deployed is None:
            raise NotMeasured(
                f"profile {self.profile.name}: nothing deployed; run `doit deploy"
                f" profile={self.profile.name}` first"
            )
        if self.settings.fabric_refusal and (why := self.settings.fabric_refusal()):
            raise NotMeasured(f"bench refused: {why}")
        url = self.endpoint(deployed)
        max_len = self.max_model_len()
        results = run_bench(
            url,
            self.profile.model.served_name,
            max_len,
            self.profile.bench,
            self.provenance(deployed, url),
        )
        gate(results, self.profile.bench.baseline)
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(results["provenance"]["started"]))
        folder = self.engine.store.area("bench") / self.profile.name / stamp
        data, report = write_results(folder, results)
        show(decode_table(results))
        say(f"results {data}")
        say(f"page {data.parent / 'report.html'} (and cells.csv, requests.csv)")
        ended = outcome(results, self.profile.bench.baseline, self.profile.name, report)
        if ended is not None:
            raise ended
        say(f"passed the gate ({len(results['gate'])} metrics)")
        say(f"report {report}")
        return report

    def max_model_len(self) -> int:
        """The context the profile serves (the models probe expects at least this)."""
        p = self.profile
        engine = p.vllm or p.simulator
        if engine is not None:
            return engine.max_model_len
        return p.sglang.context_length if p.sglang else 0

    def history(self) -> Path:
        """history.png: each gated metric over the last deployments' bench runs."""
        from pipelines.stages.bench.history import write_history
        from pipelines.stages.bench.run import say

        area = self.engine.store.area("bench") / self.profile.name
        path, skipped = write_history(area, self.profile.name, HISTORY_DEPLOYMENTS)
        for line in skipped:
            say(f"left out: {line}")
        if path is None:
            raise NotMeasured(
                f"profile {self.profile.name}: no bench run in {area}; run `doit bench"
                f" profile={self.profile.name}` first"
            )
        say(f"history {path}")
        return path

    def create_doit_tasks(self) -> Iterator[dict[str, Any]]:
        """bench: runs when asked, against what is deployed (never deploys itself);
        bench_history: plots the runs of the last deployments."""
        yield side_task(
            "bench",
            "measure the deployed endpoint (probes, sweep, saturation, needles) and gate it",
            self.run,
        )
        yield side_task(
            "bench_history",
            f"plot each gated metric over the last {HISTORY_DEPLOYMENTS} deployments' bench runs",
            self.history,
        )
