"""The Docker-hosts backend: each member a container on its host's engine (unix:// or ssh://)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipelines.core.errors import DeployError
from pipelines.core.progress import say
from pipelines.engine.keys import step_key
from pipelines.stages.deploy.fielddiff import ObjectDiff, field_changes, shown, shown_type
from pipelines.stages.deploy.health import wait_until_serving
from pipelines.stages.deploy.plan import Deployment, one_image, read_documents
from pipelines.targets.dockerengines import (
    DockerEngines,
    MemberHost,
    container_options,
    labelled_containers,
    remove_strays,
)
from pipelines.targets.pruning import DOCKER_OWNER_LABEL, Stray

if TYPE_CHECKING:
    from docker import DockerClient
    from docker.models.containers import Container

KEY_LABEL = "dev.sparkforge.deployment"  # the deployment that started the container
PROFILE_LABEL = DOCKER_OWNER_LABEL  # the fabric check's containers carry it too
# What the member runs (member_key): a container whose label matches its plan is left alone.
MEMBER_LABEL = "dev.sparkforge.member"
# The plan's address: where the member is reached, which no other container field may carry
# (SGLang listens on 0.0.0.0), so that a diff can name it.
ADDRESS_LABEL = "dev.sparkforge.address"


def container_name(profile: str, rank: int) -> str:
    """The member's container: one per profile and rank on its host."""
    return f"sparkforge-{profile}-{rank}"


@dataclass
class Change:
    """What apply did on one member, so that restore can undo exactly that."""

    member: MemberHost
    started: str | None = None  # the new container's name
    kept: str | None = None  # the previous container, stopped and renamed aside
    unchanged: bool = False


@dataclass
class DockerHosts(DockerEngines):
    """Containers on Docker engines, one per member; an engine per distinct URL."""

    timeout_s: float
    dry_run = False  # Docker engines have no dry run
    # A host folder that stands in for the members' /sys/class/infiniband in preflight (a
    # machine without RDMA devices); None: each member's own.
    rdma_sysfs: str | None = None

    def load(self, key: str, folder: Path) -> Deployment:
        """The launch plans render wrote, by rank, each with its member's engine."""
        plans = sorted(
            (body for _, body in read_documents(folder, "launch-*.yaml")), key=lambda p: p["rank"]
        )
        image = one_image({plan["image"] for plan in plans}, key)
        return Deployment(self.profile.name, key, tuple(plans), image, self.engines())

    def endpoint(self, deployment: Deployment) -> str | None:
        """Where the service answers: rank 0's server."""
        first = deployment.documents[0]
        return f"http://{first['address']}:{first['port']}"

    def preflight(
        self, deployment: Deployment, swap_off: bool, min_free: int, lock_sha256: str = ""
    ) -> list[str]:
        """Problems on any member (one line each), found without touching a deployment."""
        from pipelines.stages.deploy.dockerpreflight import docker_preflight

        return docker_preflight(self, self.rdma_sysfs, deployment, swap_off, min_free, lock_sha256)

    def apply(self, deployment: Deployment) -> list[Change]:
        """Start the deployment's containers; a member already running its key is left alone.

        Returns the changes; when interrupted, the exception carries those made so far, the
        member it stopped in included (`err.changes`)."""
        changes: list[Change] = []
        try:
            hygiene = self.profile.hygiene
            if hygiene and (hygiene.drop_page_cache or hygiene.min_free_kbytes):
                self._prepare_hosts(deployment, hygiene.drop_page_cache, hygiene.min_free_kbytes)
            for member, plan in deployment.members():
                self._apply_member(deployment, member, plan, changes)
        except BaseException as err:
            err.changes = changes  # type: ignore[attr-defined]
            raise
        return changes

    def _prepare_hosts(self, deployment: Deployment, drop: bool, min_free_kbytes: int) -> None:
        """Node hygiene on each member host before its runtime starts: the page cache dropped,
        so the model loads into memory the runtime can have, and vm.min_free_kbytes raised (a
        throwaway container of the image, allowed exactly that: CAP_SYS_ADMIN and a writable
        /proc/sys, not --privileged; vm sysctls are the host's, not namespaced)."""
        import docker.errors
        import requests

        steps, done = [], []
        if drop:
            steps.append("sync && echo 3 > /proc/sys/vm/drop_caches")
            done.append("page cache dropped")
        if min_free_kbytes:
            steps.append(f"echo {min_free_kbytes} > /proc/sys/vm/min_free_kbytes")
            done.append(f"vm.min_free_kbytes={min_free_kbytes}")
        for member, plan in deployment.members():
            api = self.client(member).api
            what = f"member {member.node}: node hygiene ({', '.join(done)}) on {member.docker}"
            try:
                # /proc/sys writable: what the CLI's --security-opt systempaths=unconfined does.
                host_config = api.create_host_config(cap_add=["SYS_ADMIN"], network_mode="none")
                host_config.update({"MaskedPaths": [], "ReadonlyPaths": []})
                created = api.create_container(
                    plan["image"],
                    ["sh", "-c", " && ".join(steps)],
                    entrypoint=[],
                    host_config=host_config,
                )
                try:
                    api.start(created["Id"])
                    code = api.wait(created["Id"], timeout=120)["StatusCode"]
                    tail = api.logs(created["Id"], tail=3).decode(errors="replace").strip()
                finally:
                    api.remove_container(created["Id"], force=True)
                if code != 0:
                    raise DeployError(f"{what} exited {code}: {tail}")
            except (docker.errors.DockerException, requests.RequestException) as err:
                raise DeployError(f"{what}: {err}") from None
            say("deploy", f"{', '.join(done)} on member {member.node}")

    def _apply_member(
        self,
        deployment: Deployment,
        member: MemberHost,
        plan: dict[str, Any],
        changes: list[Change],
    ) -> None:
        """Run the plan on one member, recording each step in changes as it happens."""
        import docker.errors

        client = self.client(member)
        name = container_name(deployment.profile, member.rank)
        current = self.find(client, name)
        wanted = member_key(plan, deployment.key)
        if (
            current is not None
            and running_key(current.labels) == wanted
            and current.status == "running"
        ):
            changes.append(Change(member, unchanged=True))
            return
        change = Change(member)
        changes.append(change)
        labels = {
            KEY_LABEL: deployment.key,
            PROFILE_LABEL: deployment.profile,
            MEMBER_LABEL: wanted,
            ADDRESS_LABEL: plan["address"],
        }
        try:
            self.pull(client, member, plan["image"])
            if current is not None:
                aside = f"{name}-prev"
                stale = self.find(client, aside)
                if stale is not None:
                    stale.remove(force=True)
                # Renamed first, so that restore finds it whatever fails after.
                current.rename(aside)
                change.kept = aside
                current.stop(timeout=10)
            container = client.containers.create(
                plan["image"], name=name, detach=True, **container_options(plan, labels)
            )
            change.started = name
            container.start()
        except docker.errors.DockerException as err:
            raise DeployError(f"member {member.node}: {member.docker}: {err}") from None

    def wait(self, deployment: Deployment, served_name: str) -> None:
        """Every member serves the model, or DeployError naming the first that does not."""
        for member, plan in deployment.members():
            client = self.client(member)
            name = container_name(deployment.profile, member.rank)
            url = f"http://{plan['address']}:{plan['port']}"
            gone = functools.partial(self._gone, client, name)
            try:
                wait_until_serving(url, served_name, self.timeout_s, gone)
            except DeployError as err:
                raise DeployError(f"member {member.node} on {member.docker}: {err}") from None

    def _gone(self, client: DockerClient, name: str) -> str | None:
        """Why the member's container is not running any more, with its last log lines."""
        container = self.find(client, name)
        if container is None:
            return f"container {name} is gone"
        if container.status in ("exited", "dead"):
            tail = container.logs(tail=5).decode(errors="replace").strip().replace("\n", " | ")
            return f"container {name} exited ({container.attrs['State']['ExitCode']}): {tail}"
        return None

    def restore(self, changes: list[Change], profile: str) -> None:
        """Undo apply on every member, even past one that cannot be reached (a host that
        dropped is the likeliest failure); DeployError naming each member not restored."""
        import docker.errors
        import requests

        failed = []
        for change in reversed(changes):
            if change.unchanged:
                continue
            try:
                self._undo(change, profile)
            except (DeployError, docker.errors.DockerException, requests.RequestException) as err:
                failed.append(f"member {change.member.node} on {change.member.docker}: {err}")
        if failed:
            raise DeployError("restore incomplete: " + "; ".join(failed))

    def _undo(self, change: Change, profile: str) -> None:
        """Remove what apply started on one member, start again what it put aside."""
        client = self.client(change.member)
        name = container_name(profile, change.member.rank)
        started = self.find(client, name)
        if started is not None and change.started:
            started.remove(force=True)
        if change.kept:
            kept = self.find(client, change.kept)
            if kept is not None:
                kept.rename(name)
                kept.start()

    def commit(self, changes: list[Change]) -> None:
        """Forget the previous containers once the new ones serve."""
        for change in changes:
            if change.kept:
                kept = self.find(self.client(change.member), change.kept)
                if kept is not None:
                    kept.remove(force=True)

    def running(self, deployment: Deployment) -> list[str]:
        """One line per member: container, state and the deployment key it runs."""
        lines = []
        for member, _plan in deployment.members():
            name = container_name(deployment.profile, member.rank)
            try:
                container = self.find(self.client(member), name)
            except DeployError as err:
                lines.append(str(err))
                continue
            if container is None:
                lines.append(f"member {member.node}: {name} not found on {member.docker}")
            else:
                key = container.labels.get(KEY_LABEL, "?")
                lines.append(
                    f"member {member.node}: {name} {container.status} on {member.docker},"
                    f" deployment {key[:16]}"
                )
        return lines

    def diff(self, deployment: Deployment) -> list[ObjectDiff]:
        """What apply would change, per member: a member running this key is left alone."""
        found = []
        for member, plan, what, current in self._members_now(deployment):
            if current is None:
                found.append(ObjectDiff(what, f"create ({plan['image']})"))
            elif (
                running_key(current.labels) != member_key(plan, deployment.key)
                or current.status != "running"
            ):
                wanted = plan_view(plan, deployment.key)
                changes = field_changes(
                    wanted, container_view(self.client(member), current, plan), extras=True
                )
                found.append(ObjectDiff(what, "replace", tuple(changes)))
        return found

    def drift(self, deployment: Deployment) -> list[ObjectDiff]:
        """Each member whose container differs from what the deployment started, by field."""
        found = []
        for member, plan, what, current in self._members_now(deployment):
            if current is None:
                found.append(ObjectDiff(what, "missing"))
                continue
            wanted = plan_view(plan, deployment.key)
            live = container_view(self.client(member), current, plan)
            changes = field_changes(wanted, live, extras=True, drift=True)
            if changes:
                found.append(ObjectDiff(what, "changed since deployed", tuple(changes)))
        return found

    def _members_now(
        self, deployment: Deployment
    ) -> Iterator[tuple[MemberHost, dict[str, Any], str, Container | None]]:
        """(member, plan, a line naming it, its container now or None) by rank."""
        for member, plan in deployment.members():
            name = container_name(deployment.profile, member.rank)
            current = self.find(self.client(member), name)
            yield member, plan, f"member {member.node} ({name} on {member.docker})", current

    def strays(self, deployment: Deployment, earlier: Deployment | None) -> list[Stray]:
        """The profile's deployment containers, on its engines and the earlier deployment's,
        that this deployment does not run (a member removed, moved to another host)."""
        wanted = {
            (member.docker, container_name(deployment.profile, member.rank))
            for member, _ in deployment.members()
        }
        engines = [*deployment.engines, *(earlier.engines if earlier else ())]
        labels: dict[str, str | None] = {PROFILE_LABEL: deployment.profile, KEY_LABEL: None}
        found = []
        for url, container in labelled_containers(self, engines, labels):
            name = container.name or ""
            # Set aside by a deploy in progress (or one killed): apply's own to restore.
            if (url, name) not in wanted and not name.endswith("-prev"):
                entry = {
                    "engine": url,
                    "container": name,
                    "deployment": container.labels.get(KEY_LABEL, ""),
                    "image": (container.attrs.get("Config") or {}).get("Image", ""),
                }
                found.append(Stray(f"container {name} on {url}", entry))
        return found

    def prune(self, strays: list[Stray]) -> list[str]:
        """Remove each stray container; one line per one that could not be removed."""
        return remove_strays(self, strays)

    def validate(self, deployment: Deployment) -> list[str]:
        """What is wrong with a deployment's kept launch plans, one line each (a record is
        hostile input: rollback re-runs what it holds)."""
        return kept_plan_problems(deployment)

    @staticmethod
    def find(client: DockerClient, name: str) -> Container | None:
        import docker.errors

        with contextlib.suppress(docker.errors.NotFound):
            return client.containers.get(name)
        return None


def container_view(
    client: DockerClient, container: Container, plan: dict[str, Any]
) -> dict[str, Any]:
    """A container as plan_view shows a plan: what the image sets itself left out."""
    import docker.errors

    attrs = container.attrs
    config = attrs.get("Config") or {}
    try:
        image = client.images.get(attrs["Image"]).attrs.get("Config") or {}
    except docker.errors.ImageNotFound:
        image = {}
    image_env = env_of(image.get("Env"))
    env = {k: v for k, v in env_of(config.get("Env")).items() if image_env.get(k) != v}
    command = config.get("Cmd")
    return {
        # A container started before the label existed cannot say: taken as the plan's,
        # rather than reported as drift on every member.
        "address": container.labels.get(ADDRESS_LABEL, plan.get("address")),
        "image": config.get("Image"),
        "env": env,
        "mounts": {
            m.get("Destination"): f"{m.get('Source')}" + ("" if m.get("RW", True) else " (ro)")
            for m in attrs.get("Mounts") or []
        },
        "command": None if command == image.get("Cmd") else command,
        "network_mode": (attrs.get("HostConfig") or {}).get("NetworkMode"),
        "labels": {MEMBER_LABEL: running_key(container.labels)},
        "state": container.status,
    }


def member_key(plan: dict[str, Any], deployment_key: str) -> str:
    """What a member runs, as its container's label says: its own plan's key where it restarts
    alone (`restarts: alone`: the simulator's members), else the deployment's key, since a
    ring's ranks form one group that a change to any of them restarts whole."""
    if plan.get("restarts") == "alone":
        return step_key(plan)
    return deployment_key


def running_key(labels: dict[str, str]) -> str | None:
    """The member key a container runs (a container started before the member label carries
    only the deployment's key, which is its member key: it was a group's)."""
    return labels.get(MEMBER_LABEL, labels.get(KEY_LABEL))


def plan_view(plan: dict[str, Any], key: str) -> dict[str, Any]:
    """The fields of a launch plan a container shows, as `_view` reads them back."""
    return {
        "address": plan.get("address"),
        "image": plan["image"],
        "env": dict(plan.get("env", {})),
        "mounts": {
            m["target"]: m["source"] + (" (ro)" if m.get("read_only") else "")
            for m in plan.get("mounts", [])
        },
        "command": plan.get("command") or None,
        "network_mode": plan.get("network_mode", "host"),
        "labels": {MEMBER_LABEL: member_key(plan, key)},
        "state": "running",
    }


def env_of(entries: list[str] | None) -> dict[str, str]:
    """A container's or image's `NAME=value` list as a dict."""
    pairs = (entry.partition("=") for entry in entries or [])
    return {name: value for name, _, value in pairs}


# field -> the JSON types a kept launch plan must have there (the fields apply and wait read).
PLAN_FIELDS: dict[str, tuple[type, ...]] = {
    "rank": (int,),
    "node": (str,),
    "image": (str,),
    "address": (str,),
    "port": (int,),
    "env": (dict,),
    "mounts": (list,),
}


def kept_plan_problems(deployment: Deployment) -> list[str]:
    """One line per launch plan field of the wrong type, a missing engine or mount field."""
    problems = []
    if len(deployment.engines) != len(deployment.documents):
        problems.append(
            f"deployment.engines: {len(deployment.engines)} for"
            f" {len(deployment.documents)} launch plans; expected one per plan"
        )
    for i, plan in enumerate(deployment.documents):
        where = f"deployment.documents[{i}]"
        if not isinstance(plan, dict):
            problems.append(f"{where}: expected a launch plan (an object)")
            continue
        for name, types in PLAN_FIELDS.items():
            value = plan.get(name)
            if not isinstance(value, types) or isinstance(value, bool):
                expected = " or ".join(t.__name__ for t in types)
                problems.append(f"{where}.{name}: expected {expected}, found {shown_type(value)}")
        mounts = plan.get("mounts")
        for j, mount in enumerate(mounts if isinstance(mounts, list) else []):
            if not (
                isinstance(mount, dict)
                and all(isinstance(mount.get(k), str) for k in ("source", "target"))
            ):
                problems.append(
                    f"{where}.mounts[{j}]: expected an object with source and target strings"
                )
        if isinstance(plan.get("env"), dict) and not all(
            isinstance(v, str) for v in plan["env"].values()
        ):
            problems.append(f"{where}.env: expected string values")
        if plan.get("restarts", "alone") != "alone":
            problems.append(
                f'{where}.restarts: expected "alone" or no such field,'
                f" found {shown(plan['restarts'])}"
            )
    return problems
