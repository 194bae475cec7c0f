"""Free loopback ports that stay free until their owner binds them.

A port the kernel hands out for ``bind(0)`` comes from its ephemeral range, the
same range it draws from for every outgoing connection and every other ``bind(0)``
(a gang's gloo pairs, zmq's ``tcp://*:*``). Between the pick and the worker's
bind, seconds later after its model loads, such a socket can take it. Ports
picked below that range, and below Kubernetes' NodePort range, are taken only by
someone who names them.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_FLOOR = 20000  # above the registered services people run on a machine
_NODE_PORTS = 30000  # Kubernetes' default NodePort range starts here


def _ceiling() -> int:
    """The first port the kernel may hand out by itself (or NodePorts, if lower)."""
    try:
        low = int(_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default
    return min(low, _NODE_PORTS)


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports on ``host`` that are free this instant and that no
    ``bind(0)`` or outgoing connection will take before their owner binds them."""
    ceiling = _ceiling()
    if 4 * n > ceiling - _FLOOR:
        raise RuntimeError(f"too few ports below the ephemeral range ({_FLOOR}..{ceiling})")
    pick = random.Random()  # its own generator: seeded tests must not pick the same ports
    socks: list[socket.socket] = []
    try:
        for _ in range(1000 * n):
            s = socket.socket()
            try:
                s.bind((host, pick.randrange(_FLOOR, ceiling)))
            except OSError:  # taken, or its owner is between bind and listen
                s.close()
                continue
            socks.append(s)
            if len(socks) == n:
                return [int(s.getsockname()[1]) for s in socks]
        raise RuntimeError(f"no {n} free ports on {host} in {_FLOOR}..{ceiling}")
    finally:
        for s in socks:
            s.close()


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]
