"""The one place that creates ZMQ sockets, so linger, HWM and bind/connect stay consistent."""

from __future__ import annotations

from typing import Final

import zmq

# Pending frames are dropped this long after close: a reply to a peer that went
# away must never keep a process from exiting.
LINGER_MS: Final = 1000
# Generous: generation replies carry images, and backpressure belongs to the
# router's admission control, not to silently dropped frames.
HWM: Final = 10_000


def _configure(sock: zmq.Socket[bytes]) -> zmq.Socket[bytes]:
    sock.setsockopt(zmq.LINGER, LINGER_MS)
    sock.setsockopt(zmq.SNDHWM, HWM)
    sock.setsockopt(zmq.RCVHWM, HWM)
    return sock


def bind_router(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str) -> zmq.Socket[bytes]:
    """The driver's ingress: a ROUTER bound on ``endpoint`` (``tcp://ADDR:PORT``)."""
    sock = _configure(ctx.socket(zmq.ROUTER))
    # Replies to a router that reconnected under the same identity must not be lost.
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
    try:
        sock.bind(endpoint)
    except zmq.ZMQError:
        sock.close(linger=0)
        raise
    return sock


def connect_dealer(
    ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, identity: bytes | None = None
) -> zmq.Socket[bytes]:
    """A client of one driver: a DEALER connected to ``endpoint``."""
    sock = _configure(ctx.socket(zmq.DEALER))
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
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
