"""An S3 server behind a shaped link: SeaweedFS in its own network namespace, a veth pair to it.

As a node reaches its storage server: the server's replies leave through an htb class of the
given rate (and a netem delay, where the kernel has netem) on the namespace's end of the veth.
Only the addresses of a private /30 are used, only inside what this module made, and the
namespace, the veth pair, the server and its data are removed on the way out, however it
is left (an exception, Ctrl-C, SIGTERM).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

NETWORK = "10.251.0.0/30"
HOST_ADDRESS = "10.251.0.1"
SERVER_ADDRESS = "10.251.0.2"
S3_PORT = 8333
UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


# weed puts its gRPC unix sockets at fixed paths, /tmp/seaweedfs-<service>-grpc-<port>.sock, and
# unix sockets are not in a network namespace: with the host's /tmp this weed would take (and,
# leaving, delete) the sockets of the local stack's weed. So it gets a /tmp of its own, in the
# mount namespace `ip netns exec` makes (mounts there do not reach the host), and its data
# lives outside /tmp.
PRIVATE_TMP = 'mount -t tmpfs fetch-bench /tmp && exec "$@"'
SCRATCH = Path(__file__).resolve().parent / "out"


class LinkError(Exception):
    """The shaped link cannot be made here (one line saying what is missing)."""


@dataclass(frozen=True)
class ShapedS3:
    """Where the shaped S3 answers, and what its link is."""

    endpoint: str
    rate: str
    delay_ms: float


def bits_per_second(rate: str) -> float:
    """'2500mbit' or '10gbit' as bits per second."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(kbit|mbit|gbit)", rate)
    if not match:
        raise LinkError(f"--link {rate}: expected a rate such as 2500mbit or 10gbit")
    return float(match[1]) * UNITS[match[2]]


def ip(*args: str, namespace: str | None = None) -> None:
    """Run ip(8) or tc(8), inside namespace when given; a failure names the command."""
    argv = [*(["ip", "netns", "exec", namespace] if namespace else []), *args]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise LinkError(f"`{' '.join(argv)}` failed: {done.stderr.strip()}")


def check_tools() -> None:
    """ip and tc (iproute2) on PATH, and the /30 free on this host."""
    for tool in ("ip", "tc"):
        if not shutil.which(tool):
            raise LinkError(f"`{tool}` not found: install iproute2")
    taken = subprocess.run(
        ["ip", "-o", "addr", "show", "to", NETWORK], capture_output=True, text=True, check=True
    ).stdout.strip()
    if taken:
        raise LinkError(f"{NETWORK} is already used on this host: {taken.splitlines()[0]}")


def shape(device: str, namespace: str, rate: str, delay_ms: float) -> None:
    """Egress of device at rate (htb, 1 ms of burst), then delay_ms more (netem) when asked."""
    burst = max(int(bits_per_second(rate) / 8 / 1000), 64 << 10)
    ip("tc", "qdisc", "add", "dev", device, "root", "handle", "1:", "htb", "default", "1",
       namespace=namespace)  # fmt: skip
    ip("tc", "class", "add", "dev", device, "parent", "1:", "classid", "1:1", "htb",
       "rate", rate, "ceil", rate, "burst", str(burst), "cburst", str(burst),
       namespace=namespace)  # fmt: skip
    if delay_ms:
        try:
            ip("tc", "qdisc", "add", "dev", device, "parent", "1:1", "handle", "10:", "netem",
               "delay", f"{delay_ms}ms", "limit", "100000", namespace=namespace)  # fmt: skip
        except LinkError as err:
            if "unknown" in str(err):
                raise LinkError(
                    "this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM is not set, "
                    "`tc qdisc ... netem` says qdisc kind unknown): no delay can be added; "
                    "run with --delay-ms 0 for a rate-only link"
                ) from None
            raise


def weed_argv(weed: str, data: Path) -> list[str]:
    """`weed mini` serving S3 on the namespace's address, every other port derived from it."""
    ports = {"master": 1, "volume": 2, "filer": 3, "admin": 4}
    grpc = {"master": 5, "volume": 6, "filer": 7, "s3": 8}
    return [
        weed, "-logtostderr=true", "mini", f"-dir={data}",
        f"-ip={SERVER_ADDRESS}", f"-ip.bind={SERVER_ADDRESS}", "-bucket=models",
        "-admin.ui=false", "-webdav=false", "-master.telemetry=false",
        "-s3.port.iceberg=0", "-s3.port.lance=0", "-volume.preStopSeconds=0",
        f"-s3.port={S3_PORT}",
        *(f"-{name}.port={S3_PORT + offset}" for name, offset in ports.items()),
        *(f"-{name}.port.grpc={S3_PORT + offset}" for name, offset in grpc.items()),
        f"-filer.localSocket={data / 'filer.sock'}", f"-s3.localSocket={data / 's3.sock'}",
    ]  # fmt: skip


def wait_for_bucket(endpoint: str, credentials: Mapping[str, str], log: Path) -> None:
    """Until the models bucket answers at endpoint (weed makes it just after S3 is up)."""
    import boto3

    client = boto3.session.Session().client(
        "s3", endpoint_url=endpoint, region_name="us-east-1", **{
            "aws_access_key_id": credentials["AWS_ACCESS_KEY_ID"],
            "aws_secret_access_key": credentials["AWS_SECRET_ACCESS_KEY"],
        },
    )  # fmt: skip
    deadline = time.monotonic() + 90
    while True:
        try:
            client.head_bucket(Bucket="models")
            return
        except Exception as err:
            if time.monotonic() > deadline:
                raise LinkError(f"S3 in the namespace never answered ({err}); see {log}") from None
            time.sleep(0.5)


def _terminate(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


@contextlib.contextmanager
def shaped_s3(
    rate: str, delay_ms: float, credentials: Mapping[str, str], scratch: Path | None = None
) -> Iterator[ShapedS3]:
    """SeaweedFS in a fresh namespace behind a veth pair shaped to rate; all removed afterwards."""
    bits_per_second(rate)
    check_tools()
    tag = f"sfb{os.getpid() % 100000}"
    namespace, host_end, server_end = f"{tag}-s3", f"{tag}h", f"{tag}s"
    previous = signal.signal(signal.SIGTERM, _terminate)
    scratch = (scratch or SCRATCH).resolve()
    if scratch.is_relative_to("/tmp"):
        raise LinkError(f"{scratch}: the shaped S3's data must live outside /tmp (PRIVATE_TMP)")
    scratch.mkdir(exist_ok=True)
    data = Path(tempfile.mkdtemp(prefix="shaped-s3-", dir=scratch))
    server = None
    made_namespace = made_link = False
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
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")} | dict(credentials)
        log = data / "weed.log"
        (data / "s3").mkdir()
        with open(log, "wb") as out:
            server = subprocess.Popen(
                ["ip", "netns", "exec", namespace, "sh", "-c", PRIVATE_TMP, "weed-in-netns",
                 *weed_argv(weed, data / "s3")],
                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        endpoint = f"http://{SERVER_ADDRESS}:{S3_PORT}"
        wait_for_bucket(endpoint, credentials, log)
        yield ShapedS3(endpoint, rate, delay_ms)
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
            subprocess.run(["ip", "link", "del", host_end], check=False, stderr=subprocess.DEVNULL)
        shutil.rmtree(data, ignore_errors=True)
        signal.signal(signal.SIGTERM, previous)
