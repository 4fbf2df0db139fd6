"""What NCCL and nccl-tests print, as data: channel transports, NET devices, results, errors.

Pure functions over text. The line formats are NCCL's own (2.28: `transport/net.cc`,
`transport/p2p.cc`, `net_ib`'s device list, `init.cc`), nccl-tests' result table
(`src/util.cu`), and the `allreduce` lines of the probe (manifests/fabric/probe.py); the fixtures
in tests/data/nccl are real logs of each.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# `host:pid:tid [dev] NCCL INFO ...`; a WARN line carries `file.cc:line` before NCCL and may
# start with a `[date time] ` stamp.
PREFIX = re.compile(r"(?P<host>[\w.-]+):(?P<pid>\d+):(?P<tid>\d+) \[(?P<dev>\d+)\] (?:\S+ )?NCCL ")
# `Channel 00/0 : 0[0] -> 1[1] via P2P/direct pointer`, `... [send] via NET/IB/1(2)/GDRDMA`.
CHANNEL = re.compile(
    r"NCCL INFO Channel (?P<channel>\d+)/(?P<conn>\d+) : (?P<src>\d+)\[\w+\] -> (?P<dst>\d+)\[\w+\]"
    r"(?: \[(?P<dir>send|receive)\])? via (?P<via>.+?)\s*$"
)
# net_ib: `NET/IB : Using [0]rocep1s0f0:1/RoCE [1]...:1/IB [RO]; OOB enP7s7:10.0.0.1<0>`.
IB_USING = re.compile(r"NCCL INFO NET/IB : Using(?P<devices>.*?);\s*OOB")
IB_DEVICE = re.compile(r"\[(?P<index>\d+)\](?P<name>[^\s:\[\]{},]+):(?P<port>\d+)/(?:IB|RoCE)")
NETWORK = re.compile(r"NCCL INFO Using network (?P<net>\S+)")
VERSION = re.compile(r"NCCL INFO NCCL version (?P<version>\S+)")
# nccl-tests: size count type redop root, then time algbw busbw #wrong out-of-place and in-place.
# #wrong is printf `%6g` of the count (`2.68435e+08` from a million up), or `N/A` unchecked.
# Time and bandwidths go through getFloatStr: fixed point while they fit their width, then
# `%.1e`/`%.0e` (a time of 10 s or more is `1.2e+07` microseconds).
NUMBER = r"\d+(?:\.\d*)?(?:e[+-]?\d+)?"
WRONG = rf"N/A|{NUMBER}"
ROW = re.compile(
    r"^\s*(?P<size>\d+)\s+(?P<count>\d+)\s+(?P<type>\w+)\s+(?P<redop>\w+)\s+(?P<root>-?\d+)"
    rf"\s+(?P<time>{NUMBER})\s+(?P<algbw>{NUMBER})\s+(?P<busbw>{NUMBER})\s+(?P<wrong>{WRONG})"
    rf"\s+(?P<ip_time>{NUMBER})\s+(?P<ip_algbw>{NUMBER})\s+(?P<ip_busbw>{NUMBER})"
    rf"\s+(?P<ip_wrong>{WRONG})"
)
AVG_BUSBW = re.compile(r"^# Avg bus bandwidth\s*:\s*(?P<value>[\d.eE+-]+)")
# The probe: one line per size on rank 0; busbw is computed here, by nccl-tests' formula.
PROBE = re.compile(
    r"^allreduce bytes=(?P<size>\d+) count=(?P<count>\d+) type=(?P<type>\w+) ranks=(?P<ranks>\d+)"
    r" time_us=(?P<time>[\d.]+) algbw_gbs=(?P<algbw>[\d.]+) wrong=(?P<wrong>\d+)"
)
# What a failed or hung collective leaves: NCCL's warnings and result codes, nccl-tests' and
# torch's failure lines (nccl-tests' footer `# Out of bounds values : 3 FAILED` counts the
# checks that found wrong values: src/util.cu writeResultFooter), watchdog timeouts.
ERRORS = re.compile(
    r"NCCL WARN|ncclSystemError|ncclInternalError|ncclRemoteError|ncclInvalidUsage"
    r"|unhandled system error|remote process exited|Test NCCL failure|Test failure"
    r"|Out of bounds values\s*:\s*[1-9]\d*\s+FAILED"
    r"|DistBackendError|Watchdog caught collective operation timeout|timed out",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class Channel:
    """One channel connection as NCCL set it up: who to whom, over which transport."""

    host: str
    channel: int
    src: int
    dst: int
    direction: str  # "send", "receive", or "" (P2P and SHM print no direction)
    via: str  # as printed: `P2P/direct pointer`, `NET/IB/0/GDRDMA`, `NET/Socket/0`

    @property
    def transport(self) -> str:
        """`NET/IB`, `NET/Socket`, `P2P`, `SHM`, `CollNet`: what the expectations name."""
        parts = self.via.split("/")
        return "/".join(parts[:2]) if parts[0] == "NET" else parts[0]

    @property
    def net_device(self) -> int | None:
        """The NET device index a NET channel runs on (`NET/IB/1(2)/...` -> 1)."""
        parts = self.via.split("/")
        if parts[0] != "NET" or len(parts) < 3:
            return None
        digits = re.match(r"\d+", parts[2])
        return int(digits.group()) if digits else None


@dataclass(frozen=True)
class Result:
    """One size of the sweep; busbw in GB/s (10^9), as nccl-tests prints it."""

    size: int
    algbw: float
    busbw: float
    wrong: float | None  # as nccl-tests printed it (%g); None where it did not check (`N/A`)


@dataclass
class NcclLog:
    """Everything the checks read from one or more members' logs."""

    versions: set[str] = field(default_factory=set)
    networks: set[str] = field(default_factory=set)  # `Using network IB` per communicator
    ib_devices: dict[str, dict[int, str]] = field(default_factory=dict)  # host -> index -> HCA
    channels: list[Channel] = field(default_factory=list)
    results: list[Result] = field(default_factory=list)
    avg_busbw: float | None = None
    errors: list[str] = field(default_factory=list)

    @property
    def transports(self) -> set[str]:
        """Every transport some channel used."""
        return {c.transport for c in self.channels}

    @property
    def largest(self) -> Result | None:
        """The result at the largest size of the sweep."""
        return max(self.results, key=lambda r: r.size, default=None)

    def hcas_used(self) -> set[str]:
        """The HCAs that NET/IB channels ran on, by each host's device list."""
        used = set()
        for c in self.channels:
            if c.transport == "NET/IB" and c.net_device is not None:
                used.add(self.ib_devices.get(c.host, {}).get(c.net_device, f"#{c.net_device}"))
        return used


def bus_bandwidth(algbw: float, ranks: int) -> float:
    """nccl-tests' all-reduce bus bandwidth: algbw x 2(n-1)/n (doc/PERFORMANCE.md)."""
    return algbw * 2 * (ranks - 1) / ranks


def wrong_count(text: str) -> float | None:
    """A #wrong column (`0`, `3`, `2.68435e+08`), or None for nccl-tests' `N/A`."""
    return None if text == "N/A" else float(text)


def parse_log(text: str, host: str = "") -> NcclLog:
    """Parse one log (any mix of NCCL INFO/WARN, nccl-tests and probe lines)."""
    log = NcclLog()
    add_log(log, text, host)
    return log


def add_log(log: NcclLog, text: str, host: str = "") -> NcclLog:
    """Add one member's log to log; host names the member where NCCL's own prefix is missing."""
    for line in text.splitlines():
        prefix = PREFIX.search(line)
        where = host or (prefix.group("host") if prefix else "")
        if m := CHANNEL.search(line):
            log.channels.append(
                Channel(
                    where,
                    int(m["channel"]),
                    int(m["src"]),
                    int(m["dst"]),
                    m["dir"] or "",
                    m["via"],
                )
            )
        elif m := IB_USING.search(line):
            devices = log.ib_devices.setdefault(where, {})
            for d in IB_DEVICE.finditer(m["devices"]):
                devices[int(d["index"])] = d["name"]
        elif m := NETWORK.search(line):
            log.networks.add(m["net"])
        elif m := VERSION.search(line):
            log.versions.add(m["version"])
        elif m := ROW.match(line):
            busbw = min(float(m["busbw"]), float(m["ip_busbw"]))  # the slower of the two
            wrong = [wrong_count(m["wrong"]), wrong_count(m["ip_wrong"])]
            log.results.append(
                Result(
                    int(m["size"]),
                    min(float(m["algbw"]), float(m["ip_algbw"])),
                    busbw,
                    None if None in wrong else sum(w for w in wrong if w is not None),
                )
            )
        elif m := AVG_BUSBW.match(line):
            log.avg_busbw = float(m["value"])
        elif m := PROBE.match(line):
            algbw = float(m["algbw"])
            log.results.append(
                Result(
                    int(m["size"]),
                    algbw,
                    bus_bandwidth(algbw, int(m["ranks"])),
                    float(m["wrong"]),
                )
            )
        if ERRORS.search(line):
            log.errors.append(f"{where}: {line.strip()}" if host else line.strip())
    return log
