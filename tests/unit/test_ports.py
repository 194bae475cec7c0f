"""Picked ports lie where no ``bind(0)`` or outgoing connection can take them."""

from __future__ import annotations

import socket
from pathlib import Path

from dpserve.plumbing.ports import free_port, free_ports


def _ephemeral_low() -> int:
    return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])


def test_picked_ports_are_distinct_bindable_and_below_the_kernels_own_range() -> None:
    ports = free_ports(32)
    assert len(set(ports)) == 32
    assert all(1024 < p < min(_ephemeral_low(), 30000) for p in ports)
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_a_held_port_is_never_picked() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", free_port()))
        held.listen()
        taken = held.getsockname()[1]
        assert taken not in free_ports(200)


def test_the_kernel_picks_from_elsewhere() -> None:
    """Why the module exists: bind(0) draws from the range the picks avoid."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        assert s.getsockname()[1] >= _ephemeral_low()
