"""Free ports on 127.0.0.1 for stacks and servers the tests start beside whatever else runs.

Never in the kernel's ephemeral range: there any client socket may take a port between the
moment a test sees it free and the moment its server binds it.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

import devstack as local_stack

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST = 10000  # below: well-known and registered services'


def ephemeral_ports() -> range:
    """The ports the kernel hands out to client sockets (ip_local_port_range)."""
    low, high = (int(n) for n in EPHEMERAL_RANGE.read_text().split())
    return range(low, high + 1)


def listening_ports() -> list[int]:
    """The ports a test may pick for a server: from LOWEST up, the ephemeral range left out."""
    ephemeral = ephemeral_ports()
    return [p for p in range(LOWEST, 65536 - 20) if p not in ephemeral]


def spare_ports(count: int = 1) -> int:
    """The first of count consecutive free ports outside the ephemeral range, from a random
    start (test sessions and workers side by side rarely try the same ones first)."""
    candidates = listening_ports()
    allowed = set(candidates)
    start = random.randrange(len(candidates))
    for port in candidates[start:] + candidates[:start]:
        block = range(port, port + count)
        if all(p in allowed for p in block) and all(map(port_free, block)):
            return port
    raise RuntimeError(f"no {count} consecutive free ports outside {ephemeral_ports()}")


def port_free(port: int) -> bool:
    """Whether nothing holds port on 127.0.0.1 (one in TIME_WAIT counts as free)."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def spare_stack_ports() -> tuple[int, int, int]:
    """An S3 port whose whole weed block is free, then free registry and ssh ports outside it."""
    allowed = set(listening_ports())
    # A random start, so test sessions running side by side on this machine do not all try the
    # same ports first.
    candidates = sorted(allowed)
    start = random.randrange(len(candidates))
    s3_port = next(
        port
        for port in candidates[start:] + candidates[:start]
        if all(p in allowed and port_free(p) for p in local_stack.s3_ports(port).values())
    )
    block = set(local_stack.s3_ports(s3_port).values())
    free = (port for port in candidates if port not in block and port_free(port))
    registry_port, ssh_port = next(free), next(free)
    return s3_port, registry_port, ssh_port
