"""Connection slots: who holds the router's connections, and whom a newcomer displaces.

A pure book (no sockets, no timers), kept by the HTTP protocol of
dpserve/router/http_server.py for one server. A connection is *idle* while the
router waits for its next request head (just opened, between keep-alive requests, or
dribbling a head) and *busy* while a request or a WebSocket runs on it.

Idle connections cost the router nothing but a slot, so they are what gives way: a
connection that opens past a cap displaces the oldest idle one (of its own peer for
the per-peer cap, of anyone for the total), as nginx reuses idle keep-alive
connections when it runs out. A flood of silent sockets therefore cannot lock anyone
out: each newcomer, a probe's included, pushes out the flood's oldest, and a newcomer
sends its head within a round trip, long before the flood has cycled through every
slot. What is held busy cannot be displaced, so a request that arrives past a cap
with nothing idle to displace is refused (429 for its own peer's cap, 503 for the
total), except the probes', which are always served (docs/router.md, Limits).
"""

from __future__ import annotations

import ipaddress
from collections import OrderedDict
from dataclasses import dataclass
from typing import Final, Generic, TypeVar

K = TypeVar("K")

# The kubelet's probes: answered under any flood (they hold a connection for
# microseconds, so serving them past a cap costs nothing).
PROBE_PATHS: Final = frozenset({"/livez", "/ready"})


@dataclass(frozen=True)
class SlotLimits:
    max_connections: int
    max_per_peer: int = 0  # 0: no per-peer cap


@dataclass(frozen=True)
class Over:
    """A request that arrived past a cap, with nothing idle to displace."""

    status: int  # 429: its own peer's cap; 503: the router's
    message: str


def peer_of(host: str | None) -> str:
    """Whose a connection is: its IPv4 address, or its IPv6 /64 (a host is given a
    whole /64, so one address each would be no cap). An IPv4-mapped IPv6 address is
    the IPv4 one."""
    if not host:
        return "local"  # a Unix socket
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network(f"{address}/64", strict=False))
    return str(address)


class SlotBook(Generic[K]):
    """The open connections (keys of any hashable kind: the server uses transports),
    by peer, and the idle ones in the order they went idle."""

    def __init__(self, limits: SlotLimits) -> None:
        self.limits = limits
        self._peer: dict[K, str] = {}
        self._count: dict[str, int] = {}
        self._idle: OrderedDict[K, None] = OrderedDict()
        self._idle_of: dict[str, OrderedDict[K, None]] = {}

    @property
    def open(self) -> int:
        return len(self._peer)

    @property
    def waiting(self) -> int:
        """The idle connections: waiting for a request head."""
        return len(self._idle)

    def count(self, peer: str) -> int:
        return self._count.get(peer, 0)

    def opened(self, key: K, peer: str) -> list[K]:
        """A new connection, idle until its head arrives; returns the connections it
        displaces, for the caller to close (they are out of the book already)."""
        self._peer[key] = peer
        self._count[peer] = self._count.get(peer, 0) + 1
        self._set_idle(key)
        return self._make_room(key)

    def busy(self, key: K, path: str) -> tuple[list[K], Over | None]:
        """A request head arrived (``path``; a WebSocket's upgrade too): the connection
        is busy. Returns the idle connections it displaces (out of the book, for the
        caller to close: some may have gone idle since it opened) and None to serve it,
        or why it is refused."""
        if key not in self._peer:
            return [], None
        self._set_busy(key)
        if path in PROBE_PATHS:
            return [], None
        shed = self._make_room(key)
        peer, limits = self._peer[key], self.limits
        if limits.max_per_peer and self._count[peer] > limits.max_per_peer:
            return shed, Over(
                429,
                f"{peer} has {self._count[peer]} connections open to this router, past "
                f"--max-connections-per-peer {limits.max_per_peer}: reuse connections "
                "(keep-alive) or close some",
            )
        if self.open > limits.max_connections:
            return shed, Over(
                503,
                f"the router holds --max-connections {limits.max_connections} busy "
                "connections; retry shortly",
            )
        return shed, None

    def idle(self, key: K) -> None:
        """Its answer is done and nothing else is queued on it: idle again, the newest."""
        if key in self._peer:
            self._set_idle(key)

    def closed(self, key: K) -> None:
        if key not in self._peer:
            return
        self._set_busy(key)
        peer = self._peer.pop(key)
        self._count[peer] -= 1
        if not self._count[peer]:
            del self._count[peer]

    def _make_room(self, newcomer: K) -> list[K]:
        """Displace the oldest idle connections past a cap (never ``newcomer``)."""
        shed: list[K] = []
        peer, limits = self._peer[newcomer], self.limits
        while limits.max_per_peer and self._count[peer] > limits.max_per_peer:
            victim = _oldest(self._idle_of.get(peer), newcomer)
            if victim is None:
                break
            shed.append(victim)
            self.closed(victim)
        while self.open > limits.max_connections:
            victim = _oldest(self._idle, newcomer)
            if victim is None:
                break
            shed.append(victim)
            self.closed(victim)
        return shed

    def _set_idle(self, key: K) -> None:
        self._set_busy(key)
        self._idle[key] = None
        self._idle_of.setdefault(self._peer[key], OrderedDict())[key] = None

    def _set_busy(self, key: K) -> None:
        if self._idle.pop(key, False) is False:
            return  # not idle
        peer = self._peer[key]
        of_peer = self._idle_of[peer]
        del of_peer[key]
        if not of_peer:
            del self._idle_of[peer]


def _oldest(idle: OrderedDict[K, None] | None, spare: K) -> K | None:
    for key in idle or ():
        if key != spare:
            return key
    return None
