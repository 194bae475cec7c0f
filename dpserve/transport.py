"""The one place that creates ZMQ sockets, so linger, HWM and bind/connect stay consistent."""

from __future__ import annotations

from typing import Any, Final, TypeVar

import zmq

# Pending frames are dropped this long after close: a reply to a peer that went
# away must never keep a process from exiting.
LINGER_MS: Final = 1000
# Generous: generation replies carry images, and backpressure belongs to the
# router's admission control, not to silently dropped frames.
HWM: Final = 10_000


S = TypeVar("S", bound="zmq.Socket[Any]")


def _configure(sock: S) -> S:
    sock.setsockopt(zmq.LINGER, LINGER_MS)
    sock.setsockopt(zmq.SNDHWM, HWM)
    sock.setsockopt(zmq.RCVHWM, HWM)
    return sock


def bind_router(
    ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, *, settle: bool = False
) -> zmq.Socket[bytes]:
    """The driver's ingress: a ROUTER bound on ``endpoint`` (``tcp://ADDR:PORT``).

    A taken port is an error, unless ``settle``: then the socket binds a free port
    on the same address, and whoever asked reads the real one (``bound_endpoint``).
    """
    sock = _configure(ctx.socket(zmq.ROUTER))
    # Replies to a router that reconnected under the same identity must not be lost.
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
    try:
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            if not (settle and exc.errno == zmq.EADDRINUSE):
                raise
            sock.bind(_any_port(endpoint))  # the OS picks: no race with another binder
    except zmq.ZMQError:
        sock.close(linger=0)
        raise
    return sock


def bound_endpoint(sock: zmq.Socket[bytes]) -> str:
    """The endpoint a socket really bound (its port resolved, as a peer connects to it)."""
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def _any_port(endpoint: str) -> str:
    address, _, _port = endpoint.rpartition(":")
    return f"{address}:*"


def connect_dealer(ctx: zmq.Context[Any], endpoint: str, *, immediate: bool = False) -> Any:
    """A client of one driver: a DEALER connected to ``endpoint``.

    ``immediate`` queues messages only on a live connection, so a send to a
    replica that is down fails at once instead of being delivered, stale, to
    whatever comes up on that address later. The router wants that; a tool
    waiting for a replica to start does not.
    """
    sock = _configure(ctx.socket(zmq.DEALER))
    if immediate:
        sock.setsockopt(zmq.IMMEDIATE, 1)
    sock.setsockopt(zmq.RECONNECT_IVL, 100)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
    sock.connect(endpoint)
    return sock


def inproc_pair(
    ctx: zmq.Context[zmq.Socket[bytes]], name: str
) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes]]:
    """A PULL (bound) and PUSH (connected) pair for handing frames between threads."""
    pull = _configure(ctx.socket(zmq.PULL))
    pull.bind(f"inproc://{name}")
    push = _configure(ctx.socket(zmq.PUSH))
    push.connect(f"inproc://{name}")
    return pull, push
