"""The driver's ingress with batching on (a real ROUTER socket; this test plays the gang
loop): a request inside a batch that is cancelled or late is answered at once while the
others run on, and the gang is told to stop only when none is left."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from dpserve.client import ReplicaClient, ReplicaTimeout
from dpserve.contract import protocol as p
from dpserve.contract import validation as pv
from dpserve.worker.batch import Batching
from dpserve.worker.commands import GangStatus
from dpserve.worker.driver import Driver
from dpserve.worker.driver.work_queue import Work
from tests.polling import past
from tests.workers import free_port

BODY = {"prompt": "x", "width": 64, "height": 64, "num_inference_steps": 2}


@pytest.fixture()
def front() -> Iterator[Driver]:
    ingress = Driver(
        f"tcp://127.0.0.1:{free_port()}",
        0,
        pv.Limits(),
        GangStatus(),
        8,
        120.0,
        2,
        batching=Batching(max_images=4, wait_s=0.05),
    )
    ingress.start()
    try:
        yield ingress
    finally:
        ingress.close()


def _batch(front: Driver, client: ReplicaClient, *sent: tuple[str, int | None]) -> list[Work]:
    for request_id, timeout_ms in sent:
        client.send_raw(p.encode(p.GENERATE, request_id, BODY, timeout_ms=timeout_ms))
    deadline = time.monotonic() + 5
    while front.scheduler.work.qsize() != len(sent):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    batch = front.scheduler.next_batch(timeout=0)
    assert [w.command.id for w in batch] == [request_id for request_id, _ in sent]
    return batch


def _result(request_id: str) -> list[bytes]:
    """What the gang's output rank would send for this request."""
    body = p.GenerateResult(images=[], replica=0, inference_time_s=1, queue_time_s=0,
                            peak_memory_mb=0)  # fmt: skip
    return p.encode(p.RESULT, request_id, body)


def _error(message: p.Message) -> p.RequestError:
    assert message.kind == p.ERROR
    return p.decode_error(message)


def test_a_cancelled_request_leaves_its_batch_and_the_others_go_on(front: Driver) -> None:
    with ReplicaClient(front.endpoint, timeout_s=5) as client:
        _batch(front, client, ("a", None), ("b", None), ("c", None))
        assert front.scheduler.halt() is None
        client.send_raw(p.encode(p.CANCEL, "x", p.CancelRequest(request_id="b")))
        deadline = time.monotonic() + 5
        while not any(
            cancelled for _, cancelled in front.scheduler.work.running()
        ):  # it reached it
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert front.scheduler.halt() is None  # "a" and "c" go on
        gone = client.recv()  # answered at this step, not when the batch ends
        error = _error(gone)
        assert (gone.id, error.code, error.status) == ("b", p.CANCELLED, 499)
        assert "dropped from its batch" in str(error)
        assert [w.command.id for w in front.scheduler.work.snapshot()] == ["a", "c"]
        front.scheduler.finished(
            [_result("a"), _result("b"), _result("c")]
        )  # as the gang's output rank
        replies = sorted(client.recv().id for _ in range(2))
        assert replies == ["a", "c"]  # "b" is not answered twice; its image is discarded
        with pytest.raises(ReplicaTimeout):
            client.recv(timeout_s=0.2)


def test_the_gang_stops_only_when_every_request_of_the_batch_must(front: Driver) -> None:
    with ReplicaClient(front.endpoint, timeout_s=5) as client:
        late_work, _ = _batch(front, client, ("late", 300), ("calm", None))
        assert front.scheduler.halt() is None and late_work.deadline is not None
        past(late_work.deadline)
        assert front.scheduler.halt() is None  # "late" passed its deadline; "calm" goes on
        late = client.recv()
        assert (late.id, _error(late).code) == ("late", p.DEADLINE_EXCEEDED)
        assert "while it ran" in str(_error(late))
        client.send_raw(p.encode(p.CANCEL, "x", p.CancelRequest(request_id="calm")))
        deadline = time.monotonic() + 5
        while (halt := front.scheduler.halt()) is None:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        # The whole gang stops; the last request is answered by the gang's own error.
        assert halt.code == p.CANCELLED and "calm" in str(halt)
        with pytest.raises(ReplicaTimeout):
            client.recv(timeout_s=0.2)
        stopped = p.encode_error("calm", halt)
        front.scheduler.finished([p.encode_error("late", halt), stopped])
        reply = client.recv()
        assert (reply.id, _error(reply).code) == ("calm", p.CANCELLED)
        with pytest.raises(ReplicaTimeout):  # "late" was answered once, at its step
            client.recv(timeout_s=0.2)


def test_a_request_late_before_its_batch_starts_is_left_out(front: Driver) -> None:
    with ReplicaClient(front.endpoint, timeout_s=5) as client:
        client.send_raw(p.encode(p.GENERATE, "a", BODY))
        client.send_raw(p.encode(p.GENERATE, "now", BODY, timeout_ms=0))
        reply = client.recv()
        assert (reply.id, _error(reply).code) == ("now", p.DEADLINE_EXCEEDED)
        assert [w.command.id for w in front.scheduler.next_batch(timeout=0)] == ["a"]
        front.scheduler.finished()
