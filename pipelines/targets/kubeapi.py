"""A thin Kubernetes REST layer over the official client: discovery, get, list, apply, delete.

Every failure becomes one DeployError line naming the API server, the request and what was
expected; no request body is ever printed (a body could name what a Secret holds).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pipelines.core.errors import DeployError, DeployUnreachable
from pipelines.targets.pruning import Stray

if TYPE_CHECKING:
    from kubernetes.client.exceptions import ApiException  # untyped: Any to mypy

FIELD_MANAGER = "sparkforge"
APPLY = "application/apply-patch+yaml"
REQUEST_TIMEOUT_S = 30


class ApiRefused(DeployError):
    """The API server answered with an error status (kept, to tell 404 from the rest)."""

    def __init__(self, line: str, status: int):
        super().__init__(line)
        self.status = status


@dataclass(frozen=True)
class KubeAccess:
    """How to reach the API server: a kubeconfig (None: the client's standard places)."""

    kubeconfig: str | None = None  # KUBECONFIG, read at the edge
    context: str | None = None  # SPARKFORGE_KUBE_CONTEXT; None: the kubeconfig's current one
    dry_run: bool = False  # SPARKFORGE_KUBE_DRY_RUN=server: every write with dryRun=All
    poll_s: float = 2.0  # between status reads while waiting
    # SPARKFORGE_STAGE_TIMEOUT: the ring staging Jobs move a member's share of 460 GB from S3
    # and the rest from its peers: hours on a slow uplink, where every other wait is minutes.
    stage_timeout_s: float = 6 * 3600.0


@dataclass(frozen=True)
class Resource:
    """Where a kind lives in the REST tree (from discovery)."""

    api_version: str
    kind: str
    plural: str
    namespaced: bool

    def path(self, name: str | None = None, namespace: str | None = None) -> str:
        """The collection's path, or one object's."""
        root = "/api/v1" if self.api_version == "v1" else f"/apis/{self.api_version}"
        if self.namespaced:
            root += f"/namespaces/{namespace}"
        return f"{root}/{self.plural}" + (f"/{name}" if name else "")


class KubeApi:
    """One API server, as the kubeconfig describes it; discovery is read once per group."""

    def __init__(self, access: KubeAccess):
        from kubernetes import config
        from kubernetes.client import ApiClient, Configuration

        self.access = access
        where = access.kubeconfig or "~/.kube/config"
        self.source = f"kubeconfig {where}" + (
            f", context {access.context}" if access.context else ""
        )
        configuration = Configuration()
        try:
            config.load_kube_config(
                config_file=access.kubeconfig,
                context=access.context,
                client_configuration=configuration,
                persist_config=False,
            )
        except (config.ConfigException, OSError, TypeError) as err:
            raise DeployError(
                f"{self.source}: {err}; expected a kubeconfig naming a cluster"
            ) from None
        self.url = configuration.host
        self.client = ApiClient(configuration)
        self._groups: dict[str, dict[str, Resource]] = {}

    def close(self) -> None:
        """Let go of the connection pool."""
        self.client.close()

    def request(
        self,
        method: str,
        path: str,
        query: dict[str, Any] | None = None,
        body: Any = None,
        content_type: str = "application/json",
        text: bool = False,
    ) -> Any:
        """One request; the decoded JSON (or text), DeployError on any failure."""
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        try:
            response = self.client.call_api(
                path,
                method,
                query_params=list((query or {}).items()),
                header_params={"Content-Type": content_type, "Accept": "application/json"},
                body=body,
                auth_settings=["BearerToken"],
                _preload_content=False,
                _request_timeout=REQUEST_TIMEOUT_S,
            )[0]
        except ApiException as err:
            raise ApiRefused(self._refusal(err, method, path), err.status) from None
        except HTTPError as err:
            raise DeployUnreachable(
                f"kubernetes API {self.url} unreachable ({type(err).__name__}) on {method} {path};"
                f" expected an API server there ({self.source})"
            ) from None
        data = response.data.decode(errors="replace")
        return data if text else json.loads(data)

    def _refusal(self, err: ApiException, method: str, path: str) -> str:
        """One line for an API server's refusal: status, its message, what was expected."""
        try:
            message = json.loads(err.body or b"{}").get("message", "")
        except ValueError:
            message = ""
        said = f"kubernetes API {self.url}: HTTP {err.status} {err.reason} on {method} {path}"
        if err.status == 401:
            return f"{said}; expected credentials it accepts ({self.source})"
        if err.status == 403:
            return f"{said}: {message}; expected RBAC allowing it for this user ({self.source})"
        return f"{said}: {message}" if message else said

    def resource(self, api_version: str, kind: str) -> Resource:
        """The REST resource of a kind, from the group version's discovery document."""
        if api_version not in self._groups:
            path = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
            try:
                listing = self.request("GET", path)
            except ApiRefused as err:
                if err.status != 404:
                    raise
                listing = {"resources": []}
            self._groups[api_version] = {
                r["kind"]: Resource(api_version, r["kind"], r["name"], r["namespaced"])
                for r in listing.get("resources", [])
                if "/" not in r["name"]  # subresources (jobs/status) share their kind
            }
        found = self._groups[api_version].get(kind)
        if found is None:
            raise DeployError(
                f"kubernetes API {self.url} does not serve {kind} ({api_version}); expected its"
                " API installed (for llmkube kinds: the operator's CRDs)"
            )
        return found

    def get(
        self, resource: Resource, name: str, namespace: str | None = None
    ) -> dict[str, Any] | None:
        """The object, or None when it does not exist."""
        try:
            found: dict[str, Any] = self.request("GET", resource.path(name, namespace))
            return found
        except ApiRefused as err:
            if err.status == 404:
                return None
            raise

    def list(self, resource: Resource, namespace: str, selector: str) -> list[dict[str, Any]]:
        """The objects a label selector picks in a namespace."""
        found = self.request("GET", resource.path(None, namespace), {"labelSelector": selector})
        items: list[dict[str, Any]] = found.get("items", [])
        return items

    def apply(self, resource: Resource, body: dict[str, Any], dry_run: bool) -> dict[str, Any]:
        """Server-side apply of one object as sparkforge, taking over conflicting fields."""
        meta = body["metadata"]
        query = {"fieldManager": FIELD_MANAGER, "force": "true", "fieldValidation": "Strict"}
        if dry_run:
            query["dryRun"] = "All"
        path = resource.path(meta["name"], meta.get("namespace"))
        applied: dict[str, Any] = self.request("PATCH", path, query, body, content_type=APPLY)
        return applied

    def delete(self, resource: Resource, name: str, namespace: str | None, dry_run: bool) -> None:
        """Delete an object and what it owns (a Job's pods); gone already is fine."""
        query = {"propagationPolicy": "Background"}
        if dry_run:
            query["dryRun"] = "All"
        try:
            self.request("DELETE", resource.path(name, namespace), query)
        except ApiRefused as err:
            if err.status != 404:
                raise


def delete_strays(api: KubeApi, strays: list[Stray], dry_run: bool) -> list[str]:
    """Delete each stray object (entry: apiVersion, kind, name, namespace); one line per one
    the API server would not delete."""
    failed = []
    for stray in strays:
        e = stray.entry
        try:
            api.delete(api.resource(e["apiVersion"], e["kind"]), e["name"], e["namespace"], dry_run)
        except DeployError as err:
            failed.append(f"{stray.what}: not deleted: {err}")
    return failed
