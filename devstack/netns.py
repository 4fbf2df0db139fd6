"""Building blocks for links made of network namespaces and veth pairs: ip, htb, weed, signals.

Test equipment (tests/perf/link.py, devstack/ringnet.py): needs root, or CAP_NET_ADMIN and
CAP_SYS_ADMIN, and iproute2. Nothing here makes or removes anything by itself.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import FrameType
from typing import NoReturn

from pipelines.core.files import last_line

UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}

# weed puts its gRPC unix sockets at fixed paths, /tmp/seaweedfs-<service>-grpc-<port>.sock, and
# unix sockets are not in a network namespace: with the host's /tmp a weed in a namespace would
# take (and, leaving, delete) the sockets of the local stack's weed. So it gets a /tmp of its
# own, in the mount namespace `ip netns exec` makes (mounts there do not reach the host), and
# its data lives outside /tmp. Use: ["ip", "netns", "exec", NS, "sh", "-c", PRIVATE_TMP, "name",
# *argv].
# The program is opened before the mount and run from that open file: a checkout in /tmp (as
# CI's may be) would otherwise be hidden from the very command that lives in it.
PRIVATE_TMP = 'exec 3<"$1" && shift && mount -t tmpfs private-tmp /tmp && exec /proc/self/fd/3 "$@"'


class LinkError(Exception):
    """A namespace, link or server cannot be made here (one line saying what is missing)."""


def bits_per_second(rate: str) -> float:
    """'2500mbit' or '10gbit' as bits per second."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(kbit|mbit|gbit)", rate)
    if not match:
        raise LinkError(f"rate {rate!r}: expected a rate such as 200mbit, 2500mbit or 10gbit")
    return float(match[1]) * UNITS[match[2]]


def ip(*args: str, namespace: str | None = None) -> str:
    """Run ip(8) or tc(8), inside namespace when given; its stdout; a failure names the command."""
    argv = [*(["ip", "netns", "exec", namespace] if namespace else []), *args]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise LinkError(f"`{' '.join(argv)}` failed: {done.stderr.strip()}")
    return done.stdout


def check_free(*networks: str) -> None:
    """ip and tc (iproute2) on PATH, and no address or route of the host inside networks."""
    for tool in ("ip", "tc"):
        if not shutil.which(tool):
            raise LinkError(f"`{tool}` not found: install iproute2")
    for network in networks:
        taken = ip("ip", "-o", "addr", "show", "to", network).strip()
        taken = taken or ip("ip", "route", "show", "root", network).strip()
        if taken:
            raise LinkError(f"{network} is already used on this host: {taken.splitlines()[0]}")


def shape(device: str, namespace: str, rate: str, delay_ms: float = 0) -> None:
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


def tx_bytes(namespace: str) -> dict[str, int]:
    """Bytes each device of namespace has sent, by device name."""
    import json

    links = json.loads(ip("ip", "-j", "-s", "-n", namespace, "link", "show"))
    return {link["ifname"]: link["stats64"]["tx"]["bytes"] for link in links}


def weed_argv(weed: str, data: Path, address: str, bind: str, port: int) -> list[str]:
    """`weed mini` serving S3 on port of bind, announcing address; every other port from port."""
    ports = {"master": 1, "volume": 2, "filer": 3, "admin": 4}
    grpc = {"master": 5, "volume": 6, "filer": 7, "s3": 8}
    return [
        weed, "-logtostderr=true", "mini", f"-dir={data}",
        f"-ip={address}", f"-ip.bind={bind}", "-bucket=models",
        "-admin.ui=false", "-webdav=false", "-master.telemetry=false",
        "-s3.port.iceberg=0", "-s3.port.lance=0", "-volume.preStopSeconds=0",
        f"-s3.port={port}",
        *(f"-{name}.port={port + offset}" for name, offset in ports.items()),
        *(f"-{name}.port.grpc={port + offset}" for name, offset in grpc.items()),
        f"-filer.localSocket={data / 'filer.sock'}", f"-s3.localSocket={data / 's3.sock'}",
    ]  # fmt: skip


def wait_for_bucket(endpoint: str, credentials: Mapping[str, str], log: Path) -> None:
    """Until the models bucket answers at endpoint (weed makes it just after S3 is up)."""
    import boto3

    client = boto3.session.Session().client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id=credentials["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=credentials["AWS_SECRET_ACCESS_KEY"],
    )
    deadline = time.monotonic() + 90
    try:
        while True:
            try:
                client.head_bucket(Bucket="models")
                return
            except Exception as err:
                if time.monotonic() > deadline:
                    raise LinkError(
                        f"S3 never answered at {endpoint} ({err}); {log_ending(log)}"
                    ) from None
                time.sleep(0.5)
    finally:
        client.close()


def log_ending(log: Path) -> str:
    """The log's last line, quoted: what to say when the log itself is about to be removed."""
    line = last_line(log)
    return f"its log ends: {line!r}" if line else f"no lines in {log}"


def _terminate(signum: int, frame: FrameType | None) -> NoReturn:
    raise KeyboardInterrupt(f"signal {signum}")


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt inside, so `finally` clean-ups run as for Ctrl-C."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread can set handlers; signals reach only it anyway
        return
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM wait until the end: a second Ctrl-C must not cut a clean-up short."""
    held = {signal.SIGINT, signal.SIGTERM}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
