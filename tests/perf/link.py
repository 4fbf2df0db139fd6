"""An S3 server behind a shaped link: SeaweedFS in its own network namespace, a veth pair to it.

As a node reaches its storage server: the server's replies leave through an htb class of the
given rate (and a netem delay, where the kernel has netem) on the namespace's end of the veth.
Only the addresses of a private /30 are used, only inside what this module made, and the
namespace, the veth pair, the server and its data are removed on the way out, however it
is left (an exception, Ctrl-C, SIGTERM). The building blocks are devstack/netns.py's.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from devstack.netns import (
    PRIVATE_TMP,
    LinkError,
    bits_per_second,
    check_free,
    ip,
    shape,
    sigterm_raises,
    wait_for_bucket,
    weed_argv,
)

__all__ = ["LinkError", "ShapedS3", "shaped_s3"]

NETWORK = "10.251.0.0/30"
HOST_ADDRESS = "10.251.0.1"
SERVER_ADDRESS = "10.251.0.2"
S3_PORT = 8333
SCRATCH = Path(__file__).resolve().parent / "out"


@dataclass(frozen=True)
class ShapedS3:
    """Where the shaped S3 answers, and what its link is."""

    endpoint: str
    rate: str
    delay_ms: float
    server_session: int  # the server's processes' session, for counting their CPU
    host_device: str  # the host's end of the veth: its rx_bytes are what the link carried


@contextlib.contextmanager
def shaped_s3(
    rate: str, delay_ms: float, credentials: Mapping[str, str], scratch: Path | None = None
) -> Iterator[ShapedS3]:
    """SeaweedFS in a fresh namespace behind a veth pair shaped to rate; all removed afterwards."""
    bits_per_second(rate)
    check_free(NETWORK)
    tag = f"sfb{os.getpid() % 100000}"
    namespace, host_end, server_end = f"{tag}-s3", f"{tag}h", f"{tag}s"
    scratch = (scratch or SCRATCH).resolve()
    if scratch.is_relative_to("/tmp"):
        raise LinkError(f"{scratch}: the shaped S3's data must live outside /tmp (PRIVATE_TMP)")
    scratch.mkdir(exist_ok=True)
    data = Path(tempfile.mkdtemp(prefix="shaped-s3-", dir=scratch))
    server = None
    made_namespace = made_link = False
    with sigterm_raises():
        try:
            ip("ip", "netns", "add", namespace)
            made_namespace = True
            ip("ip", "link", "add", host_end, "type", "veth", "peer", "name", server_end)
            made_link = True
            ip("ip", "link", "set", server_end, "netns", namespace)
            ip("ip", "addr", "add", f"{HOST_ADDRESS}/30", "dev", host_end)
            ip("ip", "link", "set", host_end, "up")
            ip("ip", "addr", "add", f"{SERVER_ADDRESS}/30", "dev", server_end, namespace=namespace)
            ip("ip", "link", "set", server_end, "up", namespace=namespace)
            ip("ip", "link", "set", "lo", "up", namespace=namespace)
            shape(server_end, namespace, rate, delay_ms)  # the server's replies: the download path
            weed = str(Path(sys.executable).parent / "weed")
            env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
            env |= dict(credentials)
            log = data / "weed.log"
            (data / "s3").mkdir()
            argv = weed_argv(weed, data / "s3", SERVER_ADDRESS, SERVER_ADDRESS, S3_PORT)
            with open(log, "wb") as out:
                server = subprocess.Popen(
                    ["ip", "netns", "exec", namespace, "sh", "-c", PRIVATE_TMP, "weed-in-netns",
                     *argv],
                    env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                )  # fmt: skip
            endpoint = f"http://{SERVER_ADDRESS}:{S3_PORT}"
            wait_for_bucket(endpoint, credentials, log)
            yield ShapedS3(endpoint, rate, delay_ms, server.pid, host_end)
        finally:
            if server is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(server.pid, signal.SIGTERM)
                try:
                    server.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    os.killpg(server.pid, signal.SIGKILL)
                    server.wait()
            if made_namespace:
                subprocess.run(["ip", "netns", "del", namespace], check=False)  # takes its veth end
            if made_link:
                subprocess.run(
                    ["ip", "link", "del", host_end], check=False, stderr=subprocess.DEVNULL
                )
            shutil.rmtree(data, ignore_errors=True)
