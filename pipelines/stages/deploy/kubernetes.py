"""The Kubernetes backend (tp3-ring): llmkube objects by server-side apply, phase by phase.

The phases follow the rendered order (pipelines/profiles/FACTS.md, "Apply order"): caches,
the Model (wait for Ready), the TP3 patch Jobs (wait for Complete), the node-prep Jobs (wait),
then the InferenceService, whose wait is `wait`. Each object carries the configuration
sparkforge applied last as an annotation, so restore can re-apply exactly what ran before, and
delete what did not exist.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipelines.core.errors import DeployError
from pipelines.core.profiles import Profile, required
from pipelines.core.progress import say
from pipelines.stages.deploy.fielddiff import ObjectDiff, field_changes
from pipelines.stages.deploy.kubeobjects import (
    Change,
    applied_differs,
    compared,
    images_of,
    kept_document_problems,
    object_name,
    owned,
    phases,
    previous_config,
    service_state,
    with_last_applied,
)
from pipelines.stages.deploy.kubewaits import Waits
from pipelines.stages.deploy.plan import Deployment, one_image, read_documents
from pipelines.targets.kubeapi import KubeAccess, KubeApi, Resource, delete_strays
from pipelines.targets.pruning import OWNER_LABEL, Stray, owner_selector


class Kubernetes:
    """llmkube objects on one cluster, through its API server (the kubeconfig's)."""

    def __init__(
        self,
        profile: Profile,
        local_engines: tuple[str, ...],
        timeout_s: float,
        kube: KubeAccess | None = None,
    ):
        # local_engines: the local stack's Docker engines, which a cluster does not use.
        self.profile = profile
        self.timeout_s = timeout_s
        self.kube = kube or KubeAccess()
        self.dry_run = self.kube.dry_run
        self._api: KubeApi | None = None
        self.waits = Waits(lambda: self.api, self.kube, timeout_s)

    def engines(self) -> tuple[str, ...]:
        """None: the cluster's nodes run the members, not Docker engines named here."""
        return ()

    @property
    def api(self) -> KubeApi:
        """The API server's client, made on first use (a no-op doit run never loads it)."""
        if self._api is None:
            self._api = KubeApi(self.kube)
        return self._api

    def close(self) -> None:
        """Let go of the API server's connections."""
        if self._api is not None:
            self._api.close()
            self._api = None

    def load(self, key: str, folder: Path) -> Deployment:
        """The objects render wrote, in the apply order its kustomization lists."""
        found = read_documents(folder)
        order = [b for _, b in found if b.get("kind") == "Kustomization"]
        files = order[0]["resources"] if order else sorted(name for name, _ in found)
        by_file: dict[str, list[dict[str, Any]]] = {}
        for name, body in found:
            by_file.setdefault(name, []).append(body)
        docs = [body for name in files for body in by_file.get(name, [])]
        if any(doc["kind"] == "Secret" for doc in docs):
            raise DeployError(f"{folder}: a Secret was rendered; expected Secrets by name only")
        image = one_image(set().union(*(images_of(doc) for doc in docs)), key)
        return Deployment(self.profile.name, key, tuple(docs), image)

    def endpoint(self, deployment: Deployment) -> str | None:
        """None: the profile does not say where the service answers from this runner."""
        return None

    def _resource(self, doc: dict[str, Any]) -> Resource:
        return self.api.resource(doc["apiVersion"], doc["kind"])

    def _body(self, doc: dict[str, Any]) -> dict[str, Any]:
        """What is applied for a rendered document: it, with the profile's ownership label,
        and that configuration in the last-applied annotation."""
        return with_last_applied(owned(doc, OWNER_LABEL, self.profile.name))

    def diff(self, deployment: Deployment) -> list[ObjectDiff]:
        """What apply would change, per object: the live object against the server-side apply
        dry run's result (the rendered object as the API server would merge it); a Job whose
        template changed against the rendered one (apply replaces it)."""
        found = []
        for doc in deployment.documents:
            resource, meta, body = self._resource(doc), doc["metadata"], self._body(doc)
            current = self.api.get(resource, meta["name"], meta.get("namespace"))
            if current is None:
                found.append(ObjectDiff(object_name(doc), "create"))
                continue
            if doc["kind"] == "Job" and applied_differs(current, body):
                changes = field_changes(compared(body), compared(current), extras=True)
                found.append(ObjectDiff(object_name(doc), "replace", tuple(changes)))
                continue
            merged = self.api.apply(resource, body, dry_run=True)
            changes = field_changes(compared(merged), compared(current), extras=True)
            if changes:
                found.append(ObjectDiff(object_name(doc), "change", tuple(changes)))
        return found

    def drift(self, deployment: Deployment) -> list[ObjectDiff]:
        """Each object whose live fields differ from what the deployment applied (fields the
        server adds of its own are not drift; items added to a named list are)."""
        found = []
        for doc in deployment.documents:
            meta = doc["metadata"]
            current = self.api.get(self._resource(doc), meta["name"], meta.get("namespace"))
            if current is None:
                found.append(ObjectDiff(object_name(doc), "missing"))
                continue
            wanted = compared(self._body(doc))
            changes = field_changes(wanted, compared(current), extras=False, drift=True)
            if changes:
                found.append(ObjectDiff(object_name(doc), "changed since deployed", tuple(changes)))
        return found

    def strays(self, deployment: Deployment, earlier: Deployment | None) -> list[Stray]:
        """Objects with the profile's ownership label, of the kinds this deployment or the
        earlier one applies, that this deployment does not contain."""
        namespace = required(self.profile.kubernetes, "kubernetes", self.profile).namespace
        docs = [*deployment.documents, *(earlier.documents if earlier else ())]
        kinds = dict.fromkeys((d["apiVersion"], d["kind"]) for d in docs)
        wanted = {
            (d["apiVersion"], d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"])
            for d in deployment.documents
        }
        # Not the fabric check's objects (labelled with their part): its own prune's.
        selector = owner_selector(self.profile.name, None)
        found = []
        for api_version, kind in kinds:
            resource = self.api.resource(api_version, kind)
            for item in self.api.list(resource, namespace, selector):
                meta = item.get("metadata") if isinstance(item, dict) else None
                name = meta.get("name") if isinstance(meta, dict) else None
                # A listed item without a name is never pruned: its DELETE path would be the
                # whole collection's.
                if not isinstance(name, str) or not name or not isinstance(meta, dict):
                    continue
                # The namespace listed, not the one the item claims: prune deletes nowhere else.
                where = namespace if resource.namespaced else None
                if (api_version, kind, where, name) in wanted:
                    continue
                entry = {
                    "apiVersion": api_version,
                    "kind": kind,
                    "name": name,
                    "namespace": where,
                    "config": previous_config(item),
                }
                doc = {"kind": kind, "metadata": {"name": name, "namespace": where}}
                found.append(Stray(object_name(doc), entry))
        return found

    def prune(self, strays: list[Stray]) -> list[str]:
        """Delete each stray object; one line per one the API server would not delete."""
        return delete_strays(self.api, strays, self.dry_run)

    def validate(self, deployment: Deployment) -> list[str]:
        """What is wrong with a deployment's kept objects, one line each (a record is hostile
        input: rollback re-applies what it holds)."""
        return kept_document_problems(deployment.documents)

    def preflight(
        self, deployment: Deployment, swap_off: bool, min_free: int, lock_sha256: str = ""
    ) -> list[str]:
        """API reachable and authorized, namespace and nodes there, image pinned, and every
        object accepted by a server-side dry run; one line per problem, nothing touched.

        min_free is not checked: the API does not show a node's disk under the model cache;
        lock_sha256 neither: the operator fills the caches from the Model's source."""
        if "@sha256:" not in deployment.image:
            return [f"image {deployment.image}: expected pinned by digest (@sha256:...)"]
        namespace = required(self.profile.kubernetes, "kubernetes", self.profile).namespace
        try:
            if self.api.get(self.api.resource("v1", "Namespace"), namespace) is None:
                return [
                    f"namespace {namespace}: not found on {self.api.url}; expected it to exist"
                    f" (kubectl create namespace {namespace})"
                ]
            problems = self._node_problems(swap_off)
        except DeployError as err:
            return [str(err)]
        for doc in deployment.documents:
            try:
                self._dry_run(doc)
            except DeployError as err:
                problems.append(str(err))
        return problems

    def _node_problems(self, swap_off: bool) -> list[str]:
        """Each member's node exists and is Ready; no swap when the profile asks (NodeSwap's
        status.nodeInfo.swap, reported by kubelets since Kubernetes 1.30)."""
        problems = []
        nodes = self.api.resource("v1", "Node")
        for member in self.profile.members:
            node = self.api.get(nodes, member.node)
            if node is None:
                problems.append(f"member {member.node}: no such node on {self.api.url}")
                continue
            status = node.get("status", {})
            ready = [c for c in status.get("conditions", []) if c.get("type") == "Ready"]
            if not ready or ready[0].get("status") != "True":
                problems.append(f"member {member.node}: node not Ready, expected Ready")
            swap = status.get("nodeInfo", {}).get("swap", {}).get("capacity", 0)
            if swap_off and swap:
                problems.append(f"member {member.node}: swap on ({swap} bytes), expected off")
        return problems

    def _dry_run(self, doc: dict[str, Any]) -> None:
        """The API server's verdict on applying doc, without applying it."""
        resource = self._resource(doc)
        meta = doc["metadata"]
        body = self._body(doc)
        if doc["kind"] == "Job":
            current = self.api.get(resource, meta["name"], meta.get("namespace"))
            if current is not None and applied_differs(current, body):
                # The real apply replaces it: ask about the delete (a dry-run apply would be
                # refused, a Job's template being immutable).
                self.api.delete(resource, meta["name"], meta.get("namespace"), dry_run=True)
                return
        self.api.apply(resource, body, dry_run=True)

    def apply(self, deployment: Deployment) -> list[Change]:
        """Apply phase by phase, waiting for each; the changes so far ride on any exception
        (`err.changes`), Ctrl-C included."""
        changes: list[Change] = []
        try:
            for name, docs in phases(deployment.documents):
                for doc in docs:
                    self._apply_one(doc, changes)
                    say("deploy", f"{changes[-1].line(self.dry_run)}")
                if not self.dry_run:
                    self.waits.phase(name, docs)
        except BaseException as err:
            err.changes = changes  # type: ignore[attr-defined]
            raise
        return changes

    def _apply_one(self, doc: dict[str, Any], changes: list[Change]) -> None:
        """Apply one object; its change is recorded before anything is written."""
        resource = self._resource(doc)
        meta = doc["metadata"]
        name, namespace = meta["name"], meta.get("namespace")
        body = self._body(doc)
        current = self.api.get(resource, name, namespace)
        before = previous_config(current) if current is not None else None
        change = Change(doc["apiVersion"], doc["kind"], name, namespace, before)
        changes.append(change)
        if current is not None and doc["kind"] == "Job" and applied_differs(current, body):
            change.replaced = True
            self.api.delete(resource, name, namespace, self.dry_run)
            if self.dry_run:
                return
            self.waits.gone(resource, name, namespace)
        applied = self.api.apply(resource, body, self.dry_run)
        version = applied.get("metadata", {}).get("resourceVersion")
        change.unchanged = (
            current is not None
            and not change.replaced
            and version == current["metadata"].get("resourceVersion")
        )

    def wait(self, deployment: Deployment, served_name: str) -> None:
        """The InferenceService is Ready with every member ready, or DeployError."""
        if not self.dry_run:
            self.waits.served(deployment)

    def restore(self, changes: list[Change], profile: str) -> None:
        """Undo apply, last change first: re-apply what was there, delete what was not."""
        failed = []
        for change in reversed(changes):
            if change.unchanged or self.dry_run:
                continue
            try:
                self._undo(change)
            except DeployError as err:
                failed.append(str(err))
        if failed:
            raise DeployError("restore incomplete: " + "; ".join(failed))

    def _undo(self, change: Change) -> None:
        resource = self.api.resource(change.api_version, change.kind)
        what = f"{change.kind}/{change.name}"
        if change.before is None or change.replaced:
            self.api.delete(resource, change.name, change.namespace, dry_run=False)
            if change.before is None:
                say("restore", f"{what} deleted (it did not exist before)")
                return
            self.waits.gone(resource, change.name, change.namespace)
        self.api.apply(resource, with_last_applied(change.before), dry_run=False)
        say("restore", f"{what} as it was before")

    def commit(self, changes: list[Change]) -> None:
        """Nothing to forget: the previous configurations lived only in the changes."""

    def running(self, deployment: Deployment) -> list[str]:
        """One line per object: there or not, and whether it is this deployment's."""
        lines = []
        for doc in deployment.documents:
            what = f"{doc['kind']}/{doc['metadata']['name']}"
            meta = doc["metadata"]
            try:
                current = self.api.get(self._resource(doc), meta["name"], meta.get("namespace"))
            except DeployError as err:
                lines.append(f"{what}: {err}")
                continue
            if current is None:
                lines.append(f"{what}: not found on {self.api.url}")
                continue
            ours = not applied_differs(current, self._body(doc))
            state = "this deployment" if ours else "differs from this deployment"
            if doc["kind"] == "InferenceService":
                members = len(doc["spec"].get("multiNode", {}).get("members", [])) or 1
                state += f", {service_state(current, members)[1]}"
            lines.append(f"{what}: {state}")
        return lines
