"""The one place that creates ZMQ sockets, so linger, HWM and bind/connect stay consistent."""

from __future__ import annotations

from typing import Any, Final, TypeVar

import zmq

from dpserve.contract.protocol import (
    MAX_REPLY_FRAME_BYTES,
    MAX_REQUEST_FRAME_BYTES,
)
from dpserve.plumbing.curve import WireKey, secure_client, secure_server

# Pending frames are dropped this long after close: a reply to a peer that went
# away must never keep a process from exiting.
LINGER_MS: Final = 1000
# Generous: generation replies carry images, and backpressure belongs to the
# router's admission control, not to silently dropped frames.
HWM: Final = 10_000
# libzmq checks MAXMSGSIZE against a frame as it travels: under CURVE that includes
# the MESSAGE command's name, nonce and box (33 bytes), so the caps get this on top.
_FRAMING_BYTES: Final = 64


S = TypeVar("S", bound="zmq.Socket[Any]")


def _configure(sock: S) -> S:
    sock.setsockopt(zmq.LINGER, LINGER_MS)
    sock.setsockopt(zmq.SNDHWM, HWM)
    sock.setsockopt(zmq.RCVHWM, HWM)
    return sock


def bind_router(
    ctx: zmq.Context[Any],
    endpoint: str,
    *,
    settle: bool = False,
    key: WireKey | None = None,
) -> Any:
    """The driver's socket: a ROUTER bound on ``endpoint`` (``tcp://ADDR:PORT``).

    A taken port is an error, unless ``settle``: then the socket binds a free port
    on the same address, and whoever asked reads the real one (``bound_endpoint``).
    With ``key`` it is a CURVE server: ``ctx`` must have a ``wire.Gatekeeper``.
    A peer that sends a frame over ``MAX_REQUEST_FRAME_BYTES`` is disconnected by
    libzmq before the frame is read whole.
    """
    sock = _configure(ctx.socket(zmq.ROUTER))
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_FRAME_BYTES + _FRAMING_BYTES)
    if key is not None:
        secure_server(sock, key)
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


def connect_dealer(
    ctx: zmq.Context[Any],
    endpoint: str,
    *,
    immediate: bool = False,
    key: WireKey | None = None,
) -> Any:
    """A client of one driver: a DEALER connected to ``endpoint``.

    ``immediate`` queues messages only on a live connection, so a send to a
    replica that is down fails at once instead of being delivered, stale, to
    whatever comes up on that address later. The router wants that; a tool
    waiting for a replica to start does not. With ``key`` it is a CURVE client
    holding the service key. A reply frame over ``MAX_REPLY_FRAME_BYTES`` drops
    the connection (the driver is reconnected to; that request fails).
    """
    sock = _configure(ctx.socket(zmq.DEALER))
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_REPLY_FRAME_BYTES + _FRAMING_BYTES)
    if key is not None:
        secure_client(sock, key)
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
