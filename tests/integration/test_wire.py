"""Malformed traffic against a real driver: answered when it has an id, else dropped."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from dpserve.client import ReplicaTimeout
from dpserve.contract import protocol as p
from tests.workers import WorkerProcess

pytestmark = pytest.mark.gang


@pytest.fixture(scope="module")
def worker(tiny_model: Path) -> Iterator[WorkerProcess]:
    with WorkerProcess(tiny_model) as w:
        yield w


def test_garbage_is_dropped_and_the_driver_stays_up(worker: WorkerProcess) -> None:
    rng = random.Random(0)
    with worker.client(timeout_s=5) as client:
        for _ in range(200):
            frames = [rng.randbytes(rng.randrange(0, 64)) for _ in range(rng.randrange(0, 3))]
            client.send_raw(frames or [b""])
        with pytest.raises(ReplicaTimeout):
            client.recv(timeout_s=0.5)  # nothing answerable was sent
        assert client.ping().status == "ok"


def test_bad_messages_with_an_id_get_error_replies(worker: WorkerProcess) -> None:
    enc = msgspec.msgpack.encode
    cases = {
        "old": enc({"v": 99, "id": "old", "kind": "ping"}),
        "nokind": enc({"v": 1, "id": "nokind"}),
        "weird": enc({"v": 1, "id": "weird", "kind": "dance"}),
        "notmap": p.encode(p.GENERATE, "notmap", [1, 2, 3])[0],
        "badctl": p.encode(p.CONTROL, "badctl", {"op": 5})[0],
    }
    with worker.client(timeout_s=10) as client:
        for request_id, header in cases.items():
            client.send_raw([header])
            reply = client.recv()
            assert reply.id == request_id and reply.kind == p.ERROR
            assert str(p.decode_error(reply))
        assert client.ping().status == "ok"


def test_truncated_request_is_answered(worker: WorkerProcess) -> None:
    frames = p.encode(p.GENERATE, "cut", {"prompt": "x", "width": 64})
    with worker.client(timeout_s=10) as client:
        client.send_raw([frames[0][:-3]])
        with pytest.raises(ReplicaTimeout):
            client.recv(timeout_s=0.5)
        client.send_raw(
            p.encode(
                p.GENERATE,
                "ok",
                {"prompt": "x", "width": 64, "height": 64, "num_inference_steps": 1, "seed": 1},
            )
        )
        assert client.recv().kind == p.RESULT


def test_queue_full_answers_overloaded(tiny_model: Path) -> None:
    with WorkerProcess(tiny_model, "--max-queue", "1") as worker, worker.client() as client:
        slow = {"prompt": "x", "width": 256, "height": 256, "num_inference_steps": 20, "seed": 1}
        for i in range(6):
            client.send_raw(p.encode(p.GENERATE, f"r{i}", slow))
        replies = [client.recv() for _ in range(6)]
        kinds = [r.kind for r in replies]
        assert kinds.count(p.RESULT) >= 1  # the queued one, more if the loop took one early
        overloaded = [p.decode_error(r) for r in replies if r.kind == p.ERROR]
        assert overloaded and all(e.code == p.OVERLOADED for e in overloaded)
