"""The authenticated wire against a live ingress: real ZMQ sockets, CURVE and frame caps.

A peer without the service key (no CURVE, or another key) gets nothing through,
and the ingress keeps serving the client that has it; a frame over the cap drops
only the peer that sent it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from dpserve.client import ReplicaClient, ReplicaTimeout
from dpserve.contract import protocol as p
from dpserve.contract import validation as pv
from dpserve.plumbing.curve import WireKey, secure_client
from dpserve.plumbing.transport import bind_router, bound_endpoint, connect_dealer
from dpserve.worker.commands import GangStatus
from dpserve.worker.driver import Driver
from tests.workers import free_port


@pytest.fixture()
def key() -> WireKey:
    return WireKey.generate()


@pytest.fixture()
def secured(key: WireKey) -> Iterator[Driver]:
    """A driver's ingress under ``key`` (no gang behind it)."""
    front = Driver(
        f"tcp://127.0.0.1:{free_port()}", 0, pv.Limits(), GangStatus(), 8, 120.0, 2, key=key
    )
    front.start()
    try:
        yield front
    finally:
        front.close()


def _raw_dealer(ctx: zmq.Context[Any], endpoint: str) -> zmq.Socket[bytes]:
    sock: zmq.Socket[bytes] = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    return sock


def _ping_frames(request_id: str) -> list[bytes]:
    return p.encode(p.PING, request_id)


def _events(monitor: zmq.Socket[bytes], wait_s: float) -> set[int]:
    seen: set[int] = set()
    end = time.monotonic() + wait_s
    while (left := end - time.monotonic()) > 0:
        if monitor.poll(int(left * 1000)):
            seen.add(recv_monitor_message(monitor)["event"])
    return seen


def test_the_key_holder_is_served(secured: Driver, key: WireKey) -> None:
    with ReplicaClient(secured.endpoint, timeout_s=5, key=key) as client:
        assert client.ping().status == "ok"
    assert secured.socket.gate is not None and secured.socket.gate.admitted >= 1


@pytest.mark.parametrize("peer", ["plaintext", "other_key", "server_key_only"])
def test_a_peer_without_the_key_gets_nothing(secured: Driver, key: WireKey, peer: str) -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = _raw_dealer(ctx, secured.endpoint)
    if peer == "other_key":
        secure_client(sock, WireKey.generate())  # a CURVE client of its own key
    elif peer == "server_key_only":
        # Knows the service's public key (it is no secret) but not its secret key.
        other = WireKey.generate()
        sock.setsockopt(zmq.CURVE_SERVERKEY, key.public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, other.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, other.secret)
    monitor = sock.get_monitor_socket()
    try:
        sock.connect(secured.endpoint)
        for i in range(5):
            sock.send_multipart(_ping_frames(f"intruder-{i}"), flags=zmq.NOBLOCK)
        assert not sock.poll(1500), "an unauthenticated peer got a reply"
        events = _events(monitor, 0.2)
        assert zmq.EVENT_HANDSHAKE_SUCCEEDED not in events
        # The driver still serves the client that holds the key, meanwhile.
        with ReplicaClient(secured.endpoint, timeout_s=5, key=key) as client:
            assert client.ping().status == "ok"
        assert not sock.poll(200)
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=0)
        ctx.term()
    if peer == "server_key_only":  # the others fail the handshake before ZAP is asked
        assert secured.socket.gate is not None and secured.socket.gate.denied >= 1


def test_a_secured_socket_without_its_gatekeeper_admits_nobody(key: WireKey) -> None:
    """Fail closed: the ZAP domain is enforced, so even the key holder is refused."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    server = bind_router(ctx, "tcp://127.0.0.1:*", key=key)  # no Gatekeeper on ctx
    client = connect_dealer(ctx, bound_endpoint(server), key=key)
    try:
        client.send_multipart(_ping_frames("anyone"))
        assert not server.poll(1500)
    finally:
        client.close(linger=0)
        server.close(linger=0)
        ctx.term()


def test_a_key_holder_gets_nothing_from_a_plaintext_driver(ingress: Driver, key: WireKey) -> None:
    """The other way round: a keyed client never talks to an unkeyed driver (which
    might be anybody's), so a missing key on either side shows, not degrades."""
    with (
        ReplicaClient(ingress.endpoint, timeout_s=1, key=key) as client,
        pytest.raises(ReplicaTimeout),
    ):
        client.ping()


def test_an_oversized_frame_drops_only_its_sender(secured: Driver, key: WireKey) -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    big = connect_dealer(ctx, secured.endpoint, key=key)
    monitor = big.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
    try:
        assert zmq.EVENT_HANDSHAKE_SUCCEEDED in _events(monitor, 1.0)
        blob = b"\0" * (p.MAX_REQUEST_FRAME_BYTES + 4096)
        big.send_multipart([*p.encode(p.PING, "too-big"), blob])
        assert zmq.EVENT_DISCONNECTED in _events(monitor, 3.0)
        assert not big.poll(200)  # nothing was answered
        with ReplicaClient(secured.endpoint, timeout_s=5, key=key) as client:
            assert client.ping().status == "ok"
            # The biggest legitimate frame still goes through (answered: the body is bad).
            client.send_raw([*p.encode(p.PING, "at-cap"), b"\0" * p.MAX_REQUEST_FRAME_BYTES])
            assert client.recv().id == "at-cap"
    finally:
        big.disable_monitor()
        monitor.close(linger=0)
        big.close(linger=0)
        ctx.term()


def test_a_driver_without_a_key_says_so(caplog: pytest.LogCaptureFixture) -> None:
    front = Driver(f"tcp://127.0.0.1:{free_port()}", 3, pv.Limits(), GangStatus(), 8, 120.0, 2)
    front.start()
    front.close()
    warned = [r for r in caplog.records if r.levelname == "WARNING"]
    assert any("WIRE IS NOT AUTHENTICATED" in r.getMessage() for r in warned)
    assert any("replica 3" in r.getMessage() for r in warned)


def test_the_caps_cover_the_biggest_legitimate_frames() -> None:
    from dpserve.contract import realtime as rt

    assert p.MAX_REQUEST_FRAME_BYTES >= 2 * rt.MAX_FIRST_FRAME_BYTES
    # One image per reply frame: raw 8-bit RGB at 4096x4096 (max_side's documented ceiling).
    assert p.MAX_REPLY_FRAME_BYTES > 3 * 4096 * 4096
