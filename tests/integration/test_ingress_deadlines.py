"""The driver's ingress on its own (a real ROUTER socket; this test plays the gang loop):
deadlines and cancels take generations out of the queue, and tell the running one."""

from __future__ import annotations

import time

import msgspec
import pytest

from dpserve.client import ReplicaClient, ReplicaTimeout
from dpserve.contract import protocol as p
from dpserve.worker.driver import Driver
from tests.polling import past

BODY = {"prompt": "x", "width": 64, "height": 64, "num_inference_steps": 2, "seed": 1}


def _client(ingress: Driver) -> ReplicaClient:
    return ReplicaClient(ingress.endpoint, timeout_s=5)


def _cancel(client: ReplicaClient, request_id: str) -> None:
    client.send_raw(
        p.encode(p.CANCEL, f"cancel-{request_id}", p.CancelRequest(request_id=request_id))
    )


def _queued(ingress: Driver, n: int) -> None:
    deadline = time.monotonic() + 5
    while ingress.scheduler.work.qsize() != n:
        assert time.monotonic() < deadline, f"queue holds {ingress.scheduler.work.qsize()}, not {n}"
        time.sleep(0.01)


def _answered_in_order(client: ReplicaClient) -> None:
    """A ping's answer is the next message: what this connection sent before it was
    handled (the ingress thread takes a connection's messages in order) and not answered."""
    client.send_raw(p.encode(p.PING, "in-order", None))
    assert client.recv().id == "in-order"


def _code(message: p.Message) -> str:
    assert message.kind == p.ERROR
    return p.decode_error(message).code


def test_queued_work_past_its_deadline_is_answered_without_the_gang(ingress: Driver) -> None:
    with _client(ingress) as client:
        sent = time.monotonic()
        client.send_raw(p.encode(p.GENERATE, "late", BODY, timeout_ms=300))
        client.send_raw(p.encode(p.GENERATE, "now", BODY, timeout_ms=0))
        client.send_raw(p.encode(p.GENERATE, "calm", BODY))  # no deadline: it waits its turn
        first = client.recv()
        assert (first.id, _code(first)) == ("now", p.DEADLINE_EXCEEDED)
        assert time.monotonic() - sent < 0.5  # at once: before "late", queued first, expired
        second = client.recv()
        waited = time.monotonic() - sent
        assert (second.id, _code(second)) == ("late", p.DEADLINE_EXCEEDED)
        assert 0.3 <= waited < 1.0  # one poll interval (0.1 s) past the deadline, load aside
        assert "before it started" in str(p.decode_error(second))
    [work] = ingress.scheduler.next_batch(timeout=0)
    assert work.command.id == "calm" and work.deadline is None
    assert ingress.scheduler.work.qsize() == 0


def test_a_cancel_takes_only_its_own_clients_queued_request(ingress: Driver) -> None:
    with _client(ingress) as mine, _client(ingress) as other:
        mine.send_raw(p.encode(p.GENERATE, "r1", BODY))
        mine.send_raw(p.encode(p.GENERATE, "r2", BODY))
        other.send_raw(p.encode(p.GENERATE, "r1", BODY))  # the same id from someone else
        _queued(ingress, 3)
        _cancel(mine, "r1")
        reply = mine.recv()
        assert (reply.id, _code(reply)) == ("r1", p.CANCELLED)
        _cancel(mine, "nobody")  # unknown (or answered already): no reply at all
        _answered_in_order(mine)
        _answered_in_order(other)  # its r1 was left alone when mine's was cancelled
    left = [work for _ in range(2) for work in ingress.scheduler.next_batch(timeout=0)]
    # Mine r2 and the other's r1 (two connections: in either order).
    assert sorted(w.command.id for w in left) == ["r1", "r2"]


def test_the_running_generation_learns_it_was_cancelled_or_is_late(ingress: Driver) -> None:
    with _client(ingress) as client:
        client.send_raw(p.encode(p.GENERATE, "run", BODY, timeout_ms=60_000))
        [work] = ingress.scheduler.next_batch(timeout=5)
        assert work.command.id == "run"
        assert ingress.scheduler.halt() is None
        _cancel(client, "run")
        deadline = time.monotonic() + 5
        while (halt := ingress.scheduler.halt()) is None:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert halt.code == p.CANCELLED and halt.status == 499
        ingress.scheduler.finished()
        assert ingress.scheduler.halt() is None  # a late cancel concerns nothing now

        client.send_raw(p.encode(p.GENERATE, "slow", BODY, timeout_ms=200))
        [slow] = ingress.scheduler.next_batch(timeout=5)
        assert ingress.scheduler.halt() is None and slow.deadline is not None
        past(slow.deadline)
        late = ingress.scheduler.halt()
        assert late is not None and late.code == p.DEADLINE_EXCEEDED
        assert "while it ran" in str(late)
        ingress.scheduler.finished()
        with pytest.raises(ReplicaTimeout):  # the gang answers a running one, not the ingress
            client.recv(timeout_s=0.2)


def test_deadlines_and_cancels_leave_sessions_and_control_ops_alone(ingress: Driver) -> None:
    with _client(ingress) as client:
        control = p.ControlRequest(op="list_loras")
        client.send_raw(p.encode(p.CONTROL, "ctl", control, timeout_ms=0))
        _queued(ingress, 1)
        _cancel(client, "ctl")
        _answered_in_order(client)  # a queued control op is not cancelled
        [work] = ingress.scheduler.next_batch(timeout=0)
        assert work.command.id == "ctl" and work.deadline is None
        _cancel(client, "ctl")
        _answered_in_order(client)  # the cancel was handled, and not answered
        assert ingress.scheduler.halt() is None
        ingress.scheduler.finished()


def test_malformed_cancels_are_answered_like_any_malformed_message(ingress: Driver) -> None:
    enc = msgspec.msgpack.encode
    cases = {
        "empty": p.encode(p.CANCEL, "empty", {})[0],
        "number": p.encode(p.CANCEL, "number", {"request_id": 5})[0],
        "list": p.encode(p.CANCEL, "list", [1, 2])[0],
        "minus": enc({"v": 1, "id": "minus", "kind": p.GENERATE, "body": BODY, "timeout_ms": -5}),
    }
    with _client(ingress) as client:
        for request_id, header in cases.items():
            client.send_raw([header])
            reply = client.recv()
            assert (reply.id, _code(reply)) == (request_id, p.INVALID_REQUEST)
        client.send_raw([enc({"v": 1, "kind": p.CANCEL, "body": {"request_id": 1}})])  # no id
        with pytest.raises(ReplicaTimeout):
            client.recv(timeout_s=0.3)
        assert client.ping().status == "ok"
    assert ingress.scheduler.work.qsize() == 0
