"""Credentials stay where they belong (issue 30, part 6): a registry's password goes to its own
host or to a token realm over HTTPS (plain HTTP only on a literal loopback address); a tcp://
Docker engine is used only with verified TLS; the blob server's workers are never root.

Real services: Debian's docker-registry, the stack's dockerd (behind a plain or a TLS socket
forwarder standing in for a tcp:// engine), nginx. The token realms and the host an upload
is sent to are small HTTP servers here, doubles for a hostile realm or host, recording what
reached them.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import http.server
import ipaddress
import json
import os
import pwd
import select
import shutil
import socket
import ssl
import stat
import subprocess
import tempfile
import threading
import time
import uuid
from pathlib import Path

import bcrypt
import pytest
import urllib3
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from support import http_double
from support.registry_server import start_registry

from pipelines.core.errors import BadInput, DeployUnreachable
from pipelines.core.profiles import parse_profile
from pipelines.core.progress import NoProgress
from pipelines.stages.images.registry import Registry
from pipelines.stages.images.registry_push import push_blob
from pipelines.stages.images.spec import ImageBadInput, ImageError
from pipelines.stages.weights.blobserver import BlobServer, BlobServerError
from pipelines.targets.dockerengines import DockerEngines, MemberHost

REPO = Path(__file__).resolve().parent.parent
USER = "sparkforge-ci"

# --- the registry's scheme ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("host", "scheme"),
    [
        ("localhost:5000", "http"),
        ("127.0.0.1:5000", "http"),
        ("127.255.3.4:5000", "http"),
        ("[::1]:5000", "http"),
        ("localhost.attacker.example:5000", "https"),
        ("localhostile.example", "https"),
        ("127.0.0.1.attacker.example:5000", "https"),
        ("127.attacker.example", "https"),
        ("ghcr.io", "https"),
        ("10.0.0.5:5000", "https"),
    ],
)
def test_plain_http_only_to_a_literal_loopback_registry(host, scheme):
    assert Registry(host).base == f"{scheme}://{host}/v2"


@pytest.mark.parametrize(
    "host",
    ["localhost@attacker.example:5000", "127.0.0.1:5000/../x", "ghcr.io?x=1", "a b", "ghcr.io#"],
)
def test_a_registry_host_that_is_more_than_host_port_is_refused(host):
    with pytest.raises(ImageBadInput) as err:
        Registry(host).base  # noqa: B018 (the property is the check)
    assert str(err.value) == (
        f"registry {host!r}: expected host[:port] (a name, an IPv4 address or an [IPv6]"
        " address, then an optional port)"
    )
    assert err.value.exit_code == 2


# --- a real registry that names a token realm, or sends an upload elsewhere -------------------


class Recorder(http_double.QuietHTTPServer):
    """An HTTP server on every address of this machine that records each request's method, path
    and headers; answers: a token (GET), a Basic challenge (PUT, PATCH), 404 otherwise."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, dict[str, str]]] = []
        super().__init__(("0.0.0.0", 0), RecordingHandler)
        self.thread = http_double.start(self)

    @property
    def port(self) -> int:
        return self.server_address[1]

    def stop(self) -> None:
        self.shutdown()
        self.server_close()


class RecordingHandler(http.server.BaseHTTPRequestHandler):
    def answer(self) -> None:
        assert isinstance(self.server, Recorder)
        headers = {name.lower(): value for name, value in self.headers.items()}
        self.server.seen.append((self.command, self.path, headers))
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        if self.command == "GET":
            body = json.dumps({"token": "not-a-token-the-registry-accepts"}).encode()
            self.send_response(200)
        else:
            body = b"who are you"
            self.send_response(401 if self.command in ("PUT", "PATCH") else 404)
            self.send_header("WWW-Authenticate", 'Basic realm="elsewhere"')
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_PUT = do_PATCH = do_POST = do_HEAD = answer

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def recorder():
    server = Recorder()
    yield server
    server.stop()


def self_signed(folder: Path) -> Path:
    """A certificate for the registry's token checks (no token here passes them)."""
    key = ec.generate_private_key(ec.SECP256R1())
    cert = certificate(key, key, "sparkforge-token", ca=True)
    path = folder / "token-root.pem"
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


@pytest.fixture
def logged_in(tmp_path, monkeypatch):
    """A Docker config holding a password for any 127.0.0.1 registry host; the password."""
    password = uuid.uuid4().hex
    docker_config = tmp_path / "docker"
    docker_config.mkdir()
    monkeypatch.setenv("DOCKER_CONFIG", str(docker_config))

    def for_host(host: str) -> None:
        auth = base64.b64encode(f"{USER}:{password}".encode()).decode()
        (docker_config / "config.json").write_text(json.dumps({"auths": {host: {"auth": auth}}}))

    yield password, for_host


def token_registry(folder: Path, realm: str) -> tuple[subprocess.Popen, str]:
    """A registry whose 401 answers name realm as its token service."""
    token = {
        "realm": realm,
        "service": "sparkforge-test",
        "issuer": "sparkforge-test",
        "rootcertbundle": str(self_signed(folder)),
    }
    return start_registry(folder, {"auth": {"token": token}})


def this_machines_address() -> str:
    """An address of this machine off loopback (where a host that is not this one would be)."""
    out = subprocess.run(
        ["ip", "-j", "-4", "addr", "show", "scope", "global"],
        capture_output=True,
        text=True,
        check=True,
    )
    for link in json.loads(out.stdout):
        for address in link.get("addr_info", []):
            return str(address["local"])
    raise AssertionError("this machine has no IPv4 address off loopback")


@pytest.mark.parametrize("realm_host", ["off loopback", "127.1", "2130706433"])
def test_the_password_never_goes_to_a_plain_http_realm_off_loopback(
    tmp_path, recorder, logged_in, realm_host
):
    # 127.1 and 2130706433 reach 127.0.0.1 but are no literal loopback address: names like
    # them can point anywhere, so what decides is the literal, never where it resolves.
    host_part = this_machines_address() if realm_host == "off loopback" else realm_host
    realm = f"http://{host_part}:{recorder.port}/token"
    proc, host = token_registry(tmp_path, realm)
    password, for_host = logged_in
    for_host(host)
    try:
        with pytest.raises(ImageError) as err:
            Registry(host).manifest_digest("sparkforge/tiny", "v1")
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    assert recorder.seen == []  # nothing was sent there, the password least of all
    assert str(err.value) == (
        f"registry {host}: token realm {realm!r} refused: credentials go only to an https://"
        " realm (plain http:// only on 127.0.0.0/8, ::1 or localhost)"
    )
    assert err.value.exit_code == 1


def test_a_loopback_realm_gets_the_login_it_asks_for(tmp_path, recorder, logged_in):
    realm = f"http://127.0.0.1:{recorder.port}/token"
    proc, host = token_registry(tmp_path, realm)
    password, for_host = logged_in
    for_host(host)
    try:
        with pytest.raises(ImageError) as err:  # the double's token is no token
            Registry(host).manifest_digest("sparkforge/tiny", "v1")
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    assert "HTTP 401" in str(err.value) and password not in str(err.value)
    [(method, path, headers)] = recorder.seen
    assert (method, path.split("?")[0]) == ("GET", "/token")
    basic = base64.b64encode(f"{USER}:{password}".encode()).decode()
    assert headers["authorization"] == f"Basic {basic}"


def test_an_upload_sent_to_another_host_carries_no_credentials(tmp_path, recorder, logged_in):
    password, for_host = logged_in
    (tmp_path / "htpasswd").write_bytes(
        f"{USER}:".encode() + bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=5)) + b"\n"
    )
    htpasswd = {"realm": "sparkforge-test", "path": str(tmp_path / "htpasswd")}
    # http.host: the registry's upload locations name another host (a hostile registry's would),
    # which answers the upload with a Basic challenge of its own.
    elsewhere = f"http://127.0.0.2:{recorder.port}"
    proc, host = start_registry(
        tmp_path, {"auth": {"htpasswd": htpasswd}, "http": {"host": elsewhere}}
    )
    for_host(host)
    blob = tmp_path / "blob"
    blob.write_bytes(b"layer bytes")
    digest = "sha256:" + hashlib.sha256(b"layer bytes").hexdigest()
    try:
        with pytest.raises(ImageError) as err:
            push_blob(Registry(host), "sparkforge/tiny", digest, blob, NoProgress())
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    assert [method for method, _, _ in recorder.seen] == ["PATCH"]  # one try, no login there
    sent = json.dumps(recorder.seen)
    basic = base64.b64encode(f"{USER}:{password}".encode()).decode()
    assert "authorization" not in sent and password not in sent and basic not in sent
    assert str(err.value) == (
        f"registry {host}: upload {digest} to sparkforge/tiny at 0: HTTP 401 who are you"
    )
    assert err.value.exit_code == 1


# --- tcp:// Docker engines ------------------------------------------------------------------


def certificate(key, issuer_key, name: str, ca: bool = False, issuer: str | None = None, **kw):
    """An X.509 certificate for key, signed by issuer_key (a self-signed one when the same)."""
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer or name)]))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if kw.get("ip"):
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(kw["ip"]))]),
            critical=False,
        )
    if kw.get("usage"):
        builder = builder.add_extension(x509.ExtendedKeyUsage([kw["usage"]]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def pem_key(key) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def make_tls(folder: Path) -> tuple[Path, Path]:
    """A CA, a server certificate for 127.0.0.1 and a client one, each side's files in the
    layout DOCKER_CERT_PATH holds (ca.pem, cert.pem, key.pem); (client folder, server folder)."""
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = certificate(ca_key, ca_key, "sparkforge-test-ca", ca=True)
    made = {}
    for role, usage in (("client", ExtendedKeyUsageOID.CLIENT_AUTH), ("server", None)):
        key = ec.generate_private_key(ec.SECP256R1())
        extra = {"usage": usage} if usage else {"ip": "127.0.0.1"}
        cert = certificate(key, ca_key, role, issuer="sparkforge-test-ca", **extra)
        (folder / role).mkdir(parents=True)
        (folder / role / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
        (folder / role / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (folder / role / "key.pem").write_bytes(pem_key(key))
        made[role] = folder / role
    return made["client"], made["server"]


class EngineForwarder:
    """tcp://127.0.0.1:PORT in front of the stack's engine socket, in plain TCP or in TLS that
    requires a client certificate (what `dockerd --tlsverify` asks); counts connections."""

    def __init__(self, engine_socket: str, server_tls: Path | None = None, impostor: bool = False):
        self.engine_socket = engine_socket
        self.context = None
        if server_tls is not None:
            self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            self.context.load_cert_chain(server_tls / "cert.pem", server_tls / "key.pem")
            self.context.load_verify_locations(server_tls / "ca.pem")
            # An impostor asks for no client certificate: it takes whatever env it is sent.
            self.context.verify_mode = ssl.CERT_NONE if impostor else ssl.CERT_REQUIRED
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.connections = 0
        threading.Thread(target=self.accept, daemon=True).start()

    def accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self.serve, args=(conn,), daemon=True).start()

    def serve(self, conn: socket.socket) -> None:
        try:
            if self.context is not None:
                conn = self.context.wrap_socket(conn, server_side=True)
            engine = socket.socket(socket.AF_UNIX)
            engine.connect(self.engine_socket)
        except (OSError, ssl.SSLError):
            conn.close()
            return
        with conn, engine:
            pump(conn, engine)

    def close(self) -> None:
        self.listener.close()


def pump(outside: socket.socket, engine: socket.socket) -> None:
    """Copy bytes both ways in one thread (a TLS socket must not read and write in two) until
    either side ends."""
    ends = {outside: engine, engine: outside}
    while True:
        ready = [outside] if isinstance(outside, ssl.SSLSocket) and outside.pending() else []
        ready = ready or select.select(list(ends), [], [], 30)[0]
        if not ready:
            return
        for source in ready:
            try:
                data = source.recv(65536)
            except (OSError, ssl.SSLError):
                return
            if not data:
                return
            ends[source].sendall(data)


@pytest.fixture
def engines():
    profile = parse_profile(REPO / "pipelines" / "profiles" / "local.yaml")
    made = DockerEngines(profile, ())
    yield made
    made.close()


def engine_socket(stack) -> str:
    url = stack.docker_hosts[0]
    assert url.startswith("unix://"), url
    return url.removeprefix("unix://")


def test_a_tcp_engine_without_tls_is_refused_before_a_byte_is_sent(stack, engines, monkeypatch):
    monkeypatch.delenv("DOCKER_TLS_VERIFY", raising=False)
    forwarder = EngineForwarder(engine_socket(stack))
    url = f"tcp://127.0.0.1:{forwarder.port}"
    try:
        with pytest.raises(BadInput) as err:
            engines.client(MemberHost(1, "ring-b", url))
    finally:
        forwarder.close()
    assert str(err.value) == (
        f"member ring-b: Docker engine {url}: tcp:// without TLS refused (container env would"
        " cross in the clear); expected DOCKER_TLS_VERIFY=1 with ca.pem, cert.pem and key.pem in"
        " DOCKER_CERT_PATH, or an ssh:// URL"
    )
    assert err.value.exit_code == 2
    assert forwarder.connections == 0


def test_tls_verify_without_certificates_is_one_line(engines, tmp_path, monkeypatch):
    monkeypatch.setenv("DOCKER_TLS_VERIFY", "1")
    monkeypatch.setenv("DOCKER_CERT_PATH", str(tmp_path))
    (tmp_path / "ca.pem").write_text("")
    url = "tcp://127.0.0.1:9"
    with pytest.raises(BadInput) as err:
        engines.client(MemberHost(1, "ring-b", url))
    assert str(err.value) == (
        f"member ring-b: Docker engine {url}: DOCKER_TLS_VERIFY is set but DOCKER_CERT_PATH"
        f" {tmp_path} lacks cert.pem, key.pem; expected ca.pem, cert.pem and key.pem"
    )
    assert err.value.exit_code == 2


def test_a_tcp_engine_with_verified_tls_is_used(stack, engines, tmp_path, monkeypatch):
    client_certs, server_certs = make_tls(tmp_path)
    monkeypatch.setenv("DOCKER_TLS_VERIFY", "1")
    monkeypatch.setenv("DOCKER_CERT_PATH", str(client_certs))
    # The engine is checked against DOCKER_CERT_PATH's CA, whatever requests' own variable says.
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", "/etc/ssl/certs/ca-certificates.crt")
    forwarder = EngineForwarder(engine_socket(stack), server_certs)
    try:
        client = engines.client(MemberHost(1, "ring-b", f"tcp://127.0.0.1:{forwarder.port}"))
        assert client.version()["ApiVersion"]
        assert client.api.base_url.startswith("https://")
    finally:
        forwarder.close()


def test_a_tcp_engine_whose_certificate_another_ca_signed_is_refused(
    stack, engines, tmp_path, monkeypatch
):
    client_certs, _ = make_tls(tmp_path / "ours")
    _, impostor = make_tls(tmp_path / "theirs")
    monkeypatch.setenv("DOCKER_TLS_VERIFY", "1")
    monkeypatch.setenv("DOCKER_CERT_PATH", str(client_certs))
    forwarder = EngineForwarder(engine_socket(stack), impostor, impostor=True)
    url = f"tcp://127.0.0.1:{forwarder.port}"
    try:
        with pytest.raises(DeployUnreachable) as err:
            engines.client(MemberHost(1, "ring-b", url))
    finally:
        forwarder.close()
    assert str(err.value) == (
        f"member ring-b: Docker engine {url} unreachable (SSLError); expected a running engine"
        " at that URL"
    )
    assert err.value.exit_code == 3


# --- the blob server's workers ---------------------------------------------------------------


@pytest.fixture
def root_store():
    """A root-owned store (blobs/ and ring/ in it) at 0700, as mkdtemp makes it, in a folder
    nobody may enter (search only)."""
    if os.geteuid() != 0:
        pytest.skip("a root-owned store needs root")
    parent = Path(tempfile.mkdtemp(dir="/var/tmp"))
    parent.chmod(0o711)
    store = parent / "store"
    (store / "blobs").mkdir(parents=True, mode=0o700)
    store.chmod(0o700)
    yield store
    shutil.rmtree(parent)


def worker_uids(master: int) -> list[int]:
    """The real uids of nginx's worker processes (the master's children)."""
    uids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if int(fields["PPid"]) == master:
            uids.append(int(fields["Uid"].split()[0]))
    return uids


def test_the_blob_servers_workers_are_not_root_and_still_serve(root_store):
    blobs = root_store / "blobs"
    data = os.urandom(20_000)
    sha = hashlib.sha256(data).hexdigest()
    (blobs / sha).write_bytes(data)
    (blobs / sha).chmod(0o444)  # as the blob store publishes it
    assert os.stat(blobs).st_uid == 0
    server = BlobServer(blobs, root_store / "ring", ("127.0.0.2",), ("127.0.0.3",), 18391)
    server.start()
    try:
        nobody = pwd.getpwnam("nobody").pw_uid
        uids: list[int] = []
        # The workers come up just after the master listens, each root until it drops to nobody
        # just after its fork (seen once in the fast lane: [65534, 0]); one root for 5 s fails.
        for _ in range(100):
            uids = worker_uids(server.process.pid)
            if uids == [nobody] * 2:
                break
            time.sleep(0.05)
        assert uids == [nobody] * 2
        peer = urllib3.PoolManager(source_address=("127.0.0.3", 0), retries=False)
        got = peer.request("GET", f"http://127.0.0.2:18391/sha256/{sha}")
        assert (got.status, got.data) == (200, data)
    finally:
        server.stop()
    # The store's folders were opened for search only: nobody else may list or write them.
    assert [stat.S_IMODE(os.stat(p).st_mode) for p in (root_store, blobs)] == [0o701, 0o701]


def test_a_root_store_below_a_folder_nobody_may_enter_is_one_line(root_store):
    root_store.parent.chmod(0o700)
    with pytest.raises(BlobServerError) as err:
        BlobServer(root_store / "blobs", root_store / "ring", ("127.0.0.2",), (), 18391)
    assert str(err.value) == (
        f"{root_store / 'blobs'}: owned by root, so nginx's workers serve it as nobody, which"
        f" may not enter {root_store.parent} (drwx------); expected every folder above the"
        f" store {root_store} searchable by others (o+x)"
    )
    assert err.value.exit_code == 1
    assert stat.S_IMODE(os.stat(root_store.parent).st_mode) == 0o700  # not ours: untouched
