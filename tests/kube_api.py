"""Test equipment: a Kubernetes API double, a real HTTP server speaking the REST calls the
Kubernetes backend makes (discovery, get, list, server-side apply, delete, pod logs), for the
official client over HTTP with a kubeconfig naming it.

It validates every applied llmkube object against the schemas derived from the operator's
CRDs with unknown fields refused (an API server's strict field validation), keeps state (an
apply that changes nothing keeps the resourceVersion), refuses a change to a Job's template,
plays scripted status transitions (one step per read), answers 401/403/409 on demand, and
records every request so tests can read what was sent. It is not an API server: no
admission, no controllers, no watch, no merge of fields owned by other managers.
"""

from __future__ import annotations

import json
import socket
import urllib.parse
from http.server import BaseHTTPRequestHandler
from typing import Any

from kube_state import (
    BY_PATH,
    LLMKUBE,
    RESOURCES,
    TOKEN,
    KubeDouble,
    Request,
    apply,
    b64,
    job_status,
    list_objects,
    read,
    service_status,
    status,
)
from support import http_double

__all__ = ["LLMKUBE", "KubeDouble", "KubeServer", "b64", "job_status", "service_status"]


class Handler(BaseHTTPRequestHandler):
    """The REST protocol for the calls the backend makes."""

    protocol_version = "HTTP/1.1"
    double: KubeDouble

    def log_message(self, *args) -> None:  # the test's output stays the backend's
        pass

    def setup(self) -> None:
        super().setup()
        # Headers and body go out as two writes: without this, Nagle holds the body until the
        # client's delayed ACK (40 ms a request).
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def _send(self, code: int, body: Any, content_type: str = "application/json") -> None:
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        self.double.requests[-1].code = code

    def _handle(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        query = dict(urllib.parse.parse_qsl(url.query))
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length).decode() if length else ""
        content_type = self.headers.get("Content-Type", "")
        d = self.double
        with d.lock:
            d.requests.append(Request(self.command, url.path, query, content_type, raw))
            if self.headers.get("Authorization") != f"Bearer {d.token}":
                return self._send(401, status(401, "Unauthorized", "Unauthorized"))
            if any(v in raw or b64(v) in raw for v in d.secret_values):
                d.leaks.append(f"{self.command} {url.path}")
                return self._send(400, status(400, "BadRequest", "a Secret's value in a body"))
            for (method, part), code in d.refuse.items():
                if method == self.command and part in url.path:
                    return self._send(code, refusal(code, self.command, url.path))
            code, body = route(d, self.command, url.path, query, content_type, raw)
            ctype = "text/plain" if isinstance(body, str) else "application/json"
            self._send(code, body, ctype)

    do_GET = do_PATCH = do_DELETE = do_PUT = do_POST = _handle


def refusal(code: int, method: str, path: str) -> dict[str, Any]:
    """The Status of a refusal asked for by a test."""
    if code == 403:
        verb = {"GET": "get", "PATCH": "patch", "DELETE": "delete"}.get(method, method.lower())
        message = f'User "ci" cannot {verb} {path}'
        return status(403, "Forbidden", message)
    if code == 409:
        message = 'Apply failed with 1 conflict: conflict with "kubectl-edit": .spec.image'
        return status(409, "Conflict", message)
    return status(code, "Unauthorized" if code == 401 else "Refused", "refused")


def discovery(path: str) -> dict[str, Any] | None:
    """/api, /apis and the group versions' resource lists."""
    if path == "/api":
        return {"kind": "APIVersions", "versions": ["v1"]}
    if path == "/apis":
        groups = sorted({v for v, *_ in RESOURCES if "/" in v})
        return {
            "kind": "APIGroupList",
            "groups": [
                {
                    "name": g.split("/")[0],
                    "versions": [{"groupVersion": g, "version": g.split("/")[1]}],
                }
                for g in groups
            ],
        }
    version = "v1" if path == "/api/v1" else path.removeprefix("/apis/")
    found = [
        {"name": p, "kind": k, "namespaced": ns, "verbs": ["get", "list", "patch", "delete"]}
        for v, k, p, ns in RESOURCES
        if v == version
    ]
    if not found:
        return None
    return {"kind": "APIResourceList", "groupVersion": version, "resources": found}


def parse(path: str) -> tuple[str, str, str | None, str | None, str | None] | None:
    """(apiVersion, plural, namespace, name, subresource) of an object or collection path."""
    parts = path.strip("/").split("/")
    if parts[0] == "api":
        version, rest = "v1", parts[2:]
    elif parts[0] == "apis" and len(parts) >= 3:
        version, rest = f"{parts[1]}/{parts[2]}", parts[3:]
    else:
        return None
    namespace = None
    if len(rest) >= 3 and rest[0] == "namespaces":
        namespace, rest = rest[1], rest[2:]
    if not rest:
        return None
    plural, name, sub = (
        rest[0],
        rest[1] if len(rest) > 1 else None,
        rest[2] if len(rest) > 2 else None,
    )
    if len(rest) == 2 and plural == "namespaces":  # /api/v1/namespaces/NAME
        return version, plural, None, rest[1], None
    return version, plural, namespace, name, sub


def route(d: KubeDouble, method: str, path: str, query: dict, ctype: str, raw: str):
    """(code, body) of one request."""
    if method == "GET" and (found := discovery(path)) is not None:
        return 200, found
    where = parse(path)
    if where is None or (where[0], where[1]) not in BY_PATH:
        return 404, status(404, "NotFound", f"the server could not find {path}")
    version, plural, namespace, name, sub = where
    kind, _ = BY_PATH[(version, plural)]
    if kind == "Pod" and method == "GET" and sub == "log":
        job = name.rsplit("-", 1)[0]
        return 200, d.logs.get(job, "")
    if method == "GET" and name is None:
        return 200, list_objects(d, kind, namespace, query.get("labelSelector", ""))
    key = (version, kind, namespace, name)
    if method == "GET":
        return read(d, key, plural)
    if method == "DELETE":
        if key not in d.objects:
            return 404, status(404, "NotFound", f'{plural} "{name}" not found')
        if query.get("dryRun") != "All":
            del d.objects[key]
            d.events.append(f"delete {kind}/{name}")
        return 200, {"kind": "Status", "apiVersion": "v1", "status": "Success"}
    if method == "PATCH":
        return apply(d, key, plural, query, ctype, raw)
    return 405, status(405, "MethodNotAllowed", f"{method} is not served by the double")


class KubeServer:
    """The double served on 127.0.0.1 in a thread, with a kubeconfig pointing at it."""

    def __init__(self, double: KubeDouble):
        handler = type("BoundHandler", (Handler,), {"double": double})
        self.double = double
        self.httpd = http_double.QuietHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = http_double.start(self.httpd)

    def kubeconfig(self, token: str = TOKEN) -> dict[str, Any]:
        """A kubeconfig naming this server, with a bearer token."""
        return {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "double", "cluster": {"server": self.url}}],
            "users": [{"name": "ci", "user": {"token": token}}],
            "contexts": [{"name": "double", "context": {"cluster": "double", "user": "ci"}}],
            "current-context": "double",
        }

    def close(self) -> None:
        """Stop serving."""
        self.httpd.shutdown()
        self.httpd.server_close()
