"""Free ports on 127.0.0.1 for stacks and servers the tests start beside whatever else runs."""

from __future__ import annotations

import random
import socket

import devstack as local_stack


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
    # A random start, so test sessions running side by side on this machine do not all try the
    # same ports first.
    start = random.randrange(21000, 40000)
    s3_port = next(
        port
        for port in range(start, 50000, 20)
        if all(port_free(p) for p in local_stack.s3_ports(port).values())
    )
    block = set(local_stack.s3_ports(s3_port).values())
    free = (port for port in range(start + 1000, 55536) if port not in block and port_free(port))
    registry_port, ssh_port = next(free), next(free)
    return s3_port, registry_port, ssh_port
