"""A ring member's blob server: Debian's nginx serving its verified blobs, read-only, to peers.

Why nginx: it serves files with Range and sendfile (the bytes never cross user space, so
serving peers costs the member almost no CPU while it hashes its own downloads), it answers
only the addresses it is told to (`allow`/`deny`), it only reads, and Debian keeps it patched.
It serves exactly two things: `/sha256/<hex>` from blobs/sha256 (a name there is published
only once verified and durable, so a partial download is never visible) and `/status.json`,
the member's progress and the blobs it has. Every other path, method or address is refused.
Its workers never run as root: a root-owned store is served as nobody.
"""

from __future__ import annotations

import contextlib
import ctypes
import grp
import os
import pwd
import shutil
import signal
import socket
import stat
import subprocess
import time
from pathlib import Path

from pipelines.core.errors import PipelineError
from pipelines.core.files import last_line

TEMP_PATHS = ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
# Who serves a root-owned store: a worker that a request subverts must not be root.
UNPRIVILEGED = "nobody"


class BlobServerError(PipelineError):
    """The blob server could not start (one line: why, and where its log is)."""


def nginx_config(
    blobs: Path, ring: Path, listen: tuple[str, ...], allow: tuple[str, ...], port: int, user: str
) -> str:
    """The nginx configuration of one member's blob server (a pure function of its inputs)."""
    temp = "\n".join(f"    {kind}_temp_path {ring / 'nginx' / kind};" for kind in TEMP_PATHS)
    listens = "\n".join(f"        listen {address}:{port};" for address in listen)
    allows = "\n".join(f"        allow {address};" for address in allow)
    return f"""# Ring staging: this member's verified blobs, read-only, to its peers only.
daemon off;
worker_processes 2;
user {user};
pid {ring / "nginx" / "nginx.pid"};
error_log {ring / "nginx" / "error.log"} warn;
events {{
    worker_connections 512;
}}
http {{
    access_log off;
    server_tokens off;
    sendfile on;
    tcp_nopush on;
    default_type application/octet-stream;
{temp}
    server {{
{listens}
{allows}
        deny all;
        location ~ "^/sha256/([0-9a-f]{{64}})$" {{
            limit_except GET {{ deny all; }}
            log_not_found off;  # peers ask before a blob is there: that is no error
            # A blob is a file, never a link: one planted in the folder is refused (403),
            # whatever it points at. Links above the folder (a mount) are not checked.
            disable_symlinks on from={blobs};
            alias {blobs}/$1;
        }}
        location = /status.json {{
            limit_except GET {{ deny all; }}
            add_header Cache-Control no-store;
            alias {ring / "status.json"};
        }}
        location / {{
            return 404;
        }}
    }}
}}
"""


def worker_user(root: Path, served: tuple[Path, ...] = ()) -> str:
    """'user group' for nginx's workers, never root: the store's owner where that is a named
    user other than root (it reads what it owns), else nobody.

    nginx's `user` takes names only. nobody reads the blobs (published 0444) once it may enter
    every folder on the way: a root-owned store's own folders get search (o+x, never read or
    write) where they lack it; a folder above the store, or one of an owner with no name, is
    not ours to open, and one line says which it is.
    """
    st = os.stat(root)
    owner = name_of_user(st.st_uid)
    if owner is not None and st.st_uid != 0:
        group = name_of_group(st.st_gid) or name_of_group(pwd.getpwnam(owner).pw_gid)
        return f"{owner} {group or owner}"
    try:
        nobody = pwd.getpwnam(UNPRIVILEGED)
        group = grp.getgrgid(nobody.pw_gid).gr_name
    except KeyError:
        raise BlobServerError(
            f"{root}: owner uid {st.st_uid} gid {st.st_gid}: no '{UNPRIVILEGED}' user or group"
            " here to serve it as (nginx's workers never run as root)"
        ) from None
    if os.geteuid() == 0:  # only root's nginx switches its workers' user
        let_in(root, st.st_uid, served, nobody.pw_uid, nobody.pw_gid)
    return f"{UNPRIVILEGED} {group}"


def let_in(root: Path, owner: int, served: tuple[Path, ...], uid: int, gid: int) -> None:
    """Make every folder on the way to root and served enterable by uid:gid, opening only a
    root-owned store's own folders (search only); refuse, in one line, any other."""
    store = Path(os.path.commonpath([root, *served]))
    for folder in (root, *served):
        while (blocked := blocked_for(folder, uid, gid)) is not None:
            st = os.stat(blocked)
            ours = owner == 0 and st.st_uid == 0 and blocked.is_relative_to(store)
            if not ours or store == Path(store.anchor) or st.st_gid == gid:
                raise not_enterable(root, owner, blocked, store)
            os.chmod(blocked, stat.S_IMODE(st.st_mode) | stat.S_IXOTH)


def not_enterable(root: Path, owner: int, blocked: Path, store: Path) -> BlobServerError:
    """The one line for a folder on the way that the workers may not enter, and is not ours."""
    mode = stat.filemode(os.stat(blocked).st_mode)
    if owner == 0:
        return BlobServerError(
            f"{root}: owned by root, so nginx's workers serve it as {UNPRIVILEGED}, which may not"
            f" enter {blocked} ({mode}); expected every folder above the store {store}"
            " searchable by others (o+x)"
        )
    return BlobServerError(
        f"{root}: owner uid {owner} has no passwd entry, so nginx serves it as nobody,"
        f" which may not enter {blocked} ({mode})"
    )


def name_of_user(uid: int) -> str | None:
    """The passwd name of uid, or None."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return None


def name_of_group(gid: int) -> str | None:
    """The group name of gid, or None."""
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return None


def blocked_for(folder: Path, uid: int, gid: int) -> Path | None:
    """The first folder on the way to folder (itself included) that uid:gid may not enter."""
    for step in [*reversed(folder.parents), folder]:
        try:
            st = os.stat(step)
        except FileNotFoundError:
            return None  # made later by the server itself, enterable (start makes ring/nginx)
        if st.st_uid == uid:
            bit = stat.S_IXUSR
        elif st.st_gid == gid:
            bit = stat.S_IXGRP
        else:
            bit = stat.S_IXOTH
        if not st.st_mode & bit:
            return step
    return None


class BlobServer:
    """An nginx process serving one member's blobs for as long as the member stages."""

    def __init__(
        self, blobs: Path, ring: Path, listen: tuple[str, ...], allow: tuple[str, ...], port: int
    ):
        self.listen, self.port, self.ring = listen, port, ring
        self.config = nginx_config(blobs, ring, listen, allow, port, worker_user(blobs, (ring,)))
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 15.0) -> BlobServer:
        """Start nginx and wait until it listens on every address, or raise with its log."""
        nginx = shutil.which("nginx") or "/usr/sbin/nginx"
        if not os.path.exists(nginx):
            raise BlobServerError("nginx not found: install Debian's nginx-light (scripts/install)")
        folder = self.ring / "nginx"
        for kind in TEMP_PATHS:
            (folder / kind).mkdir(parents=True, exist_ok=True)
        conf = folder / "nginx.conf"
        conf.write_text(self.config)
        log = folder / "error.log"
        stop_leftover(folder / "nginx.pid")
        self.process = subprocess.Popen(
            [nginx, "-e", str(log), "-p", str(folder), "-c", str(conf)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=die_with_parent,
        )
        deadline = time.monotonic() + timeout
        waiting = list(self.listen)
        while waiting:
            if self.process.poll() is not None:
                said = last_line(log) or "no log lines"
                raise BlobServerError(
                    f"nginx exited ({self.process.returncode}): {said} (log: {log})"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise BlobServerError(
                    f"nginx not listening on {waiting[0]}:{self.port} (log {log})"
                )
            with contextlib.suppress(OSError), socket.create_connection((waiting[0], self.port), 1):
                waiting.pop(0)
                continue
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        """Stop nginx (a fast shutdown: peers that still read retry elsewhere)."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None


def die_with_parent() -> None:
    """In the child before exec: SIGTERM when the member dies, however it dies (a SIGKILL too);
    nginx's master then stops its workers, so no server outlives its member."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def stop_leftover(pid_file: Path) -> None:
    """Stop an nginx a killed member left behind (it would hold the addresses)."""
    try:
        pid = int(pid_file.read_text().strip())
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except (FileNotFoundError, ValueError):
        return
    if comm != "nginx":
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    for _ in range(100):
        if not Path(f"/proc/{pid}").exists():
            return
        time.sleep(0.05)
