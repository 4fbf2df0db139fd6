"""Run the rendered fabric documents on the ring: the runtime's own launch, one process a member.

Side effects only: the Docker launcher starts one container per host through the deploy stage's
engines (unix:// or ssh://), the Kubernetes launcher applies one Job per member through its API
layer; both wait, return each member's log, and remove what they started.
"""

from __future__ import annotations

import contextlib
import io
import tarfile
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from pipelines.errors import DeployError
from pipelines.fabric.expect import FabricError
from pipelines.profiles import Profile
from pipelines.targets.dockerengines import DockerEngines, MemberHost, container_options
from pipelines.targets.kubeapi import KubeAccess, KubeApi, Resource

if TYPE_CHECKING:
    from docker import DockerClient
    from docker.models.containers import Container

    from pipelines.fabric.tasks import FabricSettings

LABEL = "dev.sparkforge.fabric"


@dataclass(frozen=True)
class MemberRun:
    """What one member's probe left: its exit status (None: did not finish) and its log."""

    rank: int
    node: str
    status: int | None
    log: str


class Launcher(Protocol):
    """Runs the fabric documents of a profile and returns each member's run, by rank."""

    def run(self, docs: list[dict[str, Any]], timeout_s: float) -> list[MemberRun]: ...


def probe_tar(files: dict[str, str]) -> bytes:
    """A tar of the plan's files (the probe), parents included, for `put_archive` at /."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        folders = sorted({p for f in files for p in _parents(f)})
        for folder in folders:
            info = tarfile.TarInfo(folder.lstrip("/"))
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        for path, text in sorted(files.items()):
            data = text.encode()
            info = tarfile.TarInfo(path.lstrip("/"))
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def _parents(path: str) -> list[str]:
    """`/a/b/c.py` -> [`/a`, `/a/b`]."""
    parts = path.strip("/").split("/")[:-1]
    return ["/" + "/".join(parts[: i + 1]) for i in range(len(parts))]


@dataclass
class DockerLauncher:
    """One container per host, from the fabric launch plans, on the members' own engines."""

    profile: Profile
    engines: DockerEngines

    def run(self, docs: list[dict[str, Any]], timeout_s: float) -> list[MemberRun]:
        """Start every member (all must be up for the rendezvous), wait, read logs, remove."""
        import docker.errors

        urls = self.engines.engines()
        started = []
        try:
            for plan in sorted(docs, key=lambda p: p["rank"]):
                member = MemberHost(plan["rank"], plan["node"], urls[plan["rank"]])
                client = self.engines.client(member)
                name = f"sparkforge-{self.profile.name}-fabric-{member.rank}"
                self._remove(client, name)
                container = client.containers.create(
                    plan["image"],
                    name=name,
                    detach=True,
                    **container_options(plan, {LABEL: self.profile.name}),
                )
                started.append((member, container))
                container.put_archive("/", probe_tar(plan.get("files", {})))
                container.start()
            return [self._wait(member, c, time.monotonic() + timeout_s) for member, c in started]
        except docker.errors.DockerException as err:
            raise FabricError(f"fabric: member {len(started)}: {err}") from None
        finally:
            for _, container in started:
                # Gone already is fine: nothing of ours is left to clean.
                with contextlib.suppress(docker.errors.DockerException):
                    container.remove(force=True)

    @staticmethod
    def _wait(member: MemberHost, container: Container, deadline: float) -> MemberRun:
        """The member's exit status (None past the deadline) and its whole log."""
        import requests

        try:
            status = container.wait(timeout=max(1.0, deadline - time.monotonic()))["StatusCode"]
        except requests.exceptions.ConnectionError:  # the SDK's read timeout
            status = None
        log = container.logs(stdout=True, stderr=True).decode(errors="replace")
        return MemberRun(member.rank, member.node, status, log)

    @staticmethod
    def _remove(client: DockerClient, name: str) -> None:
        """A leftover of an interrupted check, removed before starting again."""
        import docker.errors

        with contextlib.suppress(docker.errors.NotFound):
            client.containers.get(name).remove(force=True)

    def close(self) -> None:
        """Let go of the engines and their ssh tunnels."""
        self.engines.close()


@dataclass
class KubernetesLauncher:
    """One Job per member, applied as sparkforge; a Job's pod log is the member's log."""

    profile: Profile
    access: KubeAccess

    def run(self, docs: list[dict[str, Any]], timeout_s: float) -> list[MemberRun]:
        """Apply the probe and the Jobs (replacing earlier ones), wait, read logs, delete."""
        api = KubeApi(self.access)
        jobs = [d for d in docs if d["kind"] == "Job"]
        try:
            for doc in docs:
                resource = api.resource(doc["apiVersion"], doc["kind"])
                if doc["kind"] == "Job":  # a Job's template is immutable: a new run, a new Job
                    api.delete(
                        resource, doc["metadata"]["name"], doc["metadata"]["namespace"], False
                    )
                    self._gone(api, resource, doc, time.monotonic() + 60)
                api.apply(resource, doc, dry_run=False)
            deadline = time.monotonic() + timeout_s
            return [self._wait(api, job, rank, deadline) for rank, job in enumerate(jobs)]
        except DeployError as err:
            raise FabricError(f"fabric: {err}") from None
        finally:
            for job in jobs:
                try:
                    resource = api.resource("batch/v1", "Job")
                    api.delete(
                        resource, job["metadata"]["name"], job["metadata"]["namespace"], False
                    )
                except DeployError:
                    pass  # reported above; the next run deletes it first
            api.close()

    def _gone(self, api: KubeApi, resource: Resource, doc: dict[str, Any], deadline: float) -> None:
        """Wait until a deleted Job is gone, so the apply creates a new one."""
        meta = doc["metadata"]
        while api.get(resource, meta["name"], meta["namespace"]) is not None:
            if time.monotonic() > deadline:
                raise FabricError(f"fabric: Job {meta['name']} still there 60 s after delete")
            time.sleep(self.access.poll_s)

    def _wait(self, api: KubeApi, job: dict[str, Any], rank: int, deadline: float) -> MemberRun:
        """The Job's outcome (0 complete, 1 failed, None past the deadline) and its pod's log."""
        meta = job["metadata"]
        jobs = api.resource("batch/v1", "Job")
        status = None
        while time.monotonic() < deadline:
            found = api.get(jobs, meta["name"], meta["namespace"]) or {}
            counts = found.get("status", {})
            if counts.get("succeeded"):
                status = 0
                break
            if counts.get("failed"):
                status = 1
                break
            time.sleep(self.access.poll_s)
        node = job["spec"]["template"]["spec"].get("nodeName", "")
        return MemberRun(rank, node, status, self._log(api, meta))

    @staticmethod
    def _log(api: KubeApi, meta: dict[str, Any]) -> str:
        """The newest pod's log of a Job."""
        pods = api.resource("v1", "Pod")
        found = api.list(pods, meta["namespace"], f"job-name={meta['name']}")
        if not found:
            return ""
        newest = max(found, key=lambda p: p["metadata"].get("creationTimestamp", ""))
        path = pods.path(newest["metadata"]["name"], meta["namespace"]) + "/log"
        try:
            log: str = api.request("GET", path, text=True)
            return log
        except DeployError as err:
            return f"(no log: {err})"


def docker_launcher(profile: Profile, settings: FabricSettings) -> DockerLauncher:
    """The docker target's launch: a container on each member's own engine."""
    return DockerLauncher(profile, DockerEngines(profile, settings.site.docker_hosts))


def kubernetes_launcher(profile: Profile, settings: FabricSettings) -> KubernetesLauncher:
    """The kubernetes target's launch: one Job per member through the API server."""
    return KubernetesLauncher(profile, settings.kube)
