"""Run the rendered fabric documents on the ring: the runtime's own launch, one process a member.

Side effects only: the Docker launcher starts one container per host through the deploy stage's
engines (unix:// or ssh://), the Kubernetes launcher applies one Job per member through its API
layer; both wait, return each member's log, and remove what they started. Everything they apply
carries the profile's ownership label and the fabric part label, so that after a run they find
(`strays`) and delete (`prune`) what an earlier render made that this one no longer has.
"""

from __future__ import annotations

import contextlib
import copy
import io
import tarfile
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from pipelines.core.errors import DeployError
from pipelines.core.profiles import Profile, required
from pipelines.stages.fabric.expect import FabricError
from pipelines.targets.dockerengines import (
    DockerEngines,
    MemberHost,
    container_options,
    labelled_containers,
    remove_strays,
)
from pipelines.targets.kubeapi import KubeAccess, KubeApi, Resource, delete_strays
from pipelines.targets.pruning import (
    DOCKER_OWNER_LABEL,
    DOCKER_PART_LABEL,
    FABRIC,
    Stray,
    owner_labels,
    owner_selector,
)

if TYPE_CHECKING:
    from docker import DockerClient
    from docker.models.containers import Container

    from pipelines.stages.fabric.settings import FabricSettings

# The kinds a fabric render applies on Kubernetes: where its strays are looked for.
KUBE_KINDS = (("v1", "ConfigMap"), ("batch/v1", "Job"))


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

    def strays(self, docs: list[dict[str, Any]]) -> list[Stray]:
        """What the profile's fabric checks applied that these documents do not contain."""
        ...

    def prune(self, strays: list[Stray]) -> list[str]:
        """Delete the strays; one line per one that could not be deleted."""
        ...


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
                name = fabric_container(self.profile.name, member.rank)
                self._remove(client, name)
                container = client.containers.create(
                    plan["image"],
                    name=name,
                    detach=True,
                    **container_options(plan, self.labels),
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

    @property
    def labels(self) -> dict[str, str]:
        """What every fabric container of the profile carries (what its prune selects by)."""
        return {DOCKER_OWNER_LABEL: self.profile.name, DOCKER_PART_LABEL: FABRIC}

    def strays(self, docs: list[dict[str, Any]]) -> list[Stray]:
        """The profile's fabric containers on its members' engines that are not these plans'
        (a rank the ring no longer has, a member moved, a leftover of a killed run)."""
        urls = self.engines.engines()
        wanted = {(urls[p["rank"]], fabric_container(self.profile.name, p["rank"])) for p in docs}
        labels: dict[str, str | None] = dict(self.labels)
        found = []
        try:
            for url, container in labelled_containers(self.engines, urls, labels):
                name = container.name or ""
                if (url, name) not in wanted:
                    image = (container.attrs.get("Config") or {}).get("Image", "")
                    entry = {"engine": url, "container": name, "image": image}
                    found.append(Stray(f"container {name} on {url}", entry))
        except DeployError as err:
            raise FabricError(f"fabric: {err}") from None
        return found

    def prune(self, strays: list[Stray]) -> list[str]:
        """Remove each stray container; one line per one that could not be removed."""
        return remove_strays(self.engines, strays)

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
    _api: KubeApi | None = field(default=None, init=False, repr=False)

    @property
    def api(self) -> KubeApi:
        """The API server's client, made on first use."""
        if self._api is None:
            self._api = KubeApi(self.access)
        return self._api

    def close(self) -> None:
        """Let go of the API server's connections."""
        if self._api is not None:
            self._api.close()
            self._api = None

    def owned(self, doc: dict[str, Any]) -> dict[str, Any]:
        """A document as applied: with the profile's ownership and the fabric part labels."""
        body = copy.deepcopy(doc)
        body["metadata"].setdefault("labels", {}).update(owner_labels(self.profile.name, FABRIC))
        return body

    def run(self, docs: list[dict[str, Any]], timeout_s: float) -> list[MemberRun]:
        """Apply the probe and the Jobs (replacing earlier ones), wait, read logs, delete."""
        api = self.api
        jobs = [d for d in docs if d["kind"] == "Job"]
        try:
            for doc in docs:
                resource = api.resource(doc["apiVersion"], doc["kind"])
                if doc["kind"] == "Job":  # a Job's template is immutable: a new run, a new Job
                    api.delete(
                        resource, doc["metadata"]["name"], doc["metadata"]["namespace"], False
                    )
                    self._gone(api, resource, doc, time.monotonic() + 60)
                api.apply(resource, self.owned(doc), dry_run=False)
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

    def strays(self, docs: list[dict[str, Any]]) -> list[Stray]:
        """The profile's fabric Jobs and ConfigMaps in its namespace that these documents do
        not contain (a Job renamed, a member removed, a probe ConfigMap of an older name)."""
        namespace = required(self.profile.kubernetes, "kubernetes", self.profile).namespace
        kinds = dict.fromkeys([*KUBE_KINDS, *((d["apiVersion"], d["kind"]) for d in docs)])
        wanted = {(d["kind"], d["metadata"]["name"]) for d in docs}
        labels = owner_labels(self.profile.name, FABRIC)
        found = []
        try:
            for api_version, kind in kinds:
                resource = self.api.resource(api_version, kind)
                listed = self.api.list(
                    resource, namespace, owner_selector(self.profile.name, FABRIC)
                )
                for item in listed:
                    meta = item.get("metadata") if isinstance(item, dict) else None
                    meta = meta if isinstance(meta, dict) else {}
                    name, found_labels = meta.get("name"), meta.get("labels")
                    # A nameless item's DELETE path would be the collection's; an item without
                    # our labels is not ours, whatever the server's filter let through.
                    if not isinstance(name, str) or not name or (kind, name) in wanted:
                        continue
                    if not isinstance(found_labels, dict) or any(
                        found_labels.get(k) != v for k, v in labels.items()
                    ):
                        continue
                    entry = {
                        "apiVersion": api_version,
                        "kind": kind,
                        "name": name,
                        "namespace": namespace,
                    }
                    found.append(Stray(f"{kind}/{name} in {namespace}", entry))
        except DeployError as err:
            raise FabricError(f"fabric: {err}") from None
        return found

    def prune(self, strays: list[Stray]) -> list[str]:
        """Delete each stray object; one line per one the API server would not delete."""
        return delete_strays(self.api, strays, dry_run=False)

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


def fabric_container(profile: str, rank: int) -> str:
    """A member's fabric container: one per profile and rank on its host."""
    return f"sparkforge-{profile}-fabric-{rank}"


def docker_launcher(profile: Profile, settings: FabricSettings) -> DockerLauncher:
    """The docker target's launch: a container on each member's own engine."""
    return DockerLauncher(profile, DockerEngines(profile, settings.site.docker_hosts))


def kubernetes_launcher(profile: Profile, settings: FabricSettings) -> KubernetesLauncher:
    """The kubernetes target's launch: one Job per member through the API server."""
    return KubernetesLauncher(profile, settings.kube)
