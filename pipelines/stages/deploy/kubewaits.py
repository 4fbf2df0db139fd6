"""How the Kubernetes backend waits: for a phase's objects to finish (the Model staged, every
Job complete), for a deleted object to go, for the InferenceService to serve; a line of where it
stands each minute, a failed Job's last log lines in its error."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

from pipelines.core.errors import DeployError
from pipelines.core.progress import say
from pipelines.stages.deploy.kubeobjects import job_state, service_state
from pipelines.stages.deploy.plan import Deployment
from pipelines.targets.kubeapi import KubeAccess, KubeApi, Resource

LOG_LINES = 5
# The ring staging Jobs' phase (their container's name): the one wait measured in hours.
STAGING_PHASE = "jobs stage-weights"
PROGRESS_EVERY_S = 60.0


class Waits:
    """The waits of one deploy against one API server (its client asked for when first used)."""

    def __init__(self, api: Callable[[], KubeApi], kube: KubeAccess, timeout_s: float):
        self._api = api
        self.kube = kube
        self.timeout_s = timeout_s

    @property
    def api(self) -> KubeApi:
        """The API server's client (the backend's, made on first use)."""
        return self._api()

    def poll(
        self, what: str, pending: Callable[[], str | None], timeout_s: float | None = None
    ) -> None:
        """Call pending until it returns None (done) or raises; DeployError after the timeout
        (the deploy's unless given); a line of where it stands each minute meanwhile."""
        limit = timeout_s or self.timeout_s
        started = time.monotonic()
        told = started
        while True:
            state = pending()
            if state is None:
                return
            now = time.monotonic()
            if now - started >= limit:
                raise DeployError(f"{what}: not done after {limit:g} s ({state})")
            if now - told >= PROGRESS_EVERY_S:
                told = now
                say("deploy", f"waiting for {what}: {state} ({now - started:.0f} s of {limit:g})")
            time.sleep(self.kube.poll_s)

    def get(self, doc: dict[str, Any]) -> dict[str, Any]:
        meta = doc["metadata"]
        found = self.api.get(
            self.api.resource(doc["apiVersion"], doc["kind"]), meta["name"], meta.get("namespace")
        )
        if found is None:
            raise DeployError(f"{doc['kind']}/{meta['name']}: gone while waiting for it")
        return found

    def gone(self, resource: Resource, name: str, namespace: str | None) -> None:
        """Wait until a deleted object is gone (a Job's pods go first)."""

        def pending() -> str | None:
            return None if self.api.get(resource, name, namespace) is None else "still there"

        self.poll(f"{resource.kind}/{name} deletion", pending)

    def phase(self, name: str, docs: list[dict[str, Any]]) -> None:
        """Wait for what a phase must finish: the Model staged, every Job complete."""
        if name == "Model":
            # Where the lock is not complete the operator downloads the model itself (460 GB):
            # staging, on staging's clock.
            for doc in docs:
                self.poll(
                    f"Model/{doc['metadata']['name']}",
                    functools.partial(self.model, doc),
                    self.kube.stage_timeout_s,
                )
        elif name.startswith("jobs "):
            timeout = self.kube.stage_timeout_s if name == STAGING_PHASE else None
            self.poll(name, lambda: self.jobs(docs), timeout)

    def model(self, doc: dict[str, Any]) -> str | None:
        """None once the Model is Ready; where it stands otherwise; DeployError if it failed."""
        status = self.get(doc).get("status", {})
        phase = status.get("phase") or "no phase yet"
        if phase == "Failed":
            said = [c.get("message", "") for c in status.get("conditions", [])]
            raise DeployError(f"Model/{doc['metadata']['name']} failed: {'; '.join(said)}")
        return None if phase == "Ready" else f"phase {phase}"

    def jobs(self, docs: list[dict[str, Any]]) -> str | None:
        """None when every Job completed; DeployError naming the member of a failed one."""
        running = 0
        for doc in docs:
            state, message = job_state(self.get(doc))
            if state == "Failed":
                member = doc["spec"]["template"]["spec"].get("nodeName", "?")
                tail = self.log_tail(doc)
                raise DeployError(
                    f"member {member}: Job {doc['metadata']['name']} failed: {message}"
                    + (f"; log: {tail}" if tail else "")
                )
            running += state == "Running"
        return f"{running} of {len(docs)} Jobs running" if running else None

    def log_tail(self, doc: dict[str, Any]) -> str:
        """The last lines its newest pod logged, on one line ('' when there is none)."""
        meta = doc["metadata"]
        pods = self.api.resource("v1", "Pod")
        try:
            found = self.api.list(pods, meta["namespace"], f"job-name={meta['name']}")
            if not found:
                return ""
            newest = max(found, key=lambda p: p["metadata"].get("creationTimestamp", ""))
            path = pods.path(newest["metadata"]["name"], meta["namespace"]) + "/log"
            text = self.api.request("GET", path, {"tailLines": LOG_LINES}, text=True)
        except DeployError as err:
            return f"(no log: {err})"
        return " | ".join(line for line in text.splitlines()[-LOG_LINES:] if line.strip())

    def served(self, deployment: Deployment) -> None:
        """The InferenceService is Ready with every member ready, or DeployError."""
        for doc in deployment.documents:
            if doc["kind"] != "InferenceService":
                continue
            members = len(doc["spec"].get("multiNode", {}).get("members", [])) or 1

            def pending(doc: dict[str, Any] = doc, members: int = members) -> str | None:
                state, said = service_state(self.get(doc), members)
                if state == "Failed":
                    raise DeployError(f"InferenceService/{doc['metadata']['name']} failed: {said}")
                return None if state == "Ready" else said

            self.poll(f"InferenceService/{doc['metadata']['name']}", pending)
