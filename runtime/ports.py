"""A free TCP port for a server that another process binds a moment later (``pstrain local``'s coordinator).

Picking a port by binding port 0 and closing it races with every process started meanwhile: their servers bind
port 0 and their outgoing connections take a local port, both from the kernel's ephemeral range, and on a busy host
one of them sometimes gets the port just picked before the coordinator binds it (seen in ``bench/step.py``: the
coordinator failed with "Failed to bind to address"). A port *below* that range is never handed out by the kernel,
so only a server told to bind it explicitly could take it; one is chosen at random there and checked by binding it.
No gRPC here: ``LocalCluster`` forks after importing this.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST = 10_000  # below this, ports that fixed services commonly use
TRIES = 64


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for port-0 binds and outgoing connections (Linux's default where it cannot be read)."""
    try:
        low, high = (int(part) for part in EPHEMERAL_RANGE.read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def free_port(host: str = "127.0.0.1") -> int:
    """A port on ``host`` that nothing is bound to now, below the ephemeral range where there is room for it."""
    low, _ = ephemeral_range()
    # SystemRandom: processes forked from one parent share the module PRNG's state and would try the same ports.
    for port in random.SystemRandom().sample(range(LOWEST, low), min(TRIES, max(low - LOWEST, 0))):
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:  # no room below the range (an unusual ip_local_port_range): the old way
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


__all__ = ["ephemeral_range", "free_port"]
