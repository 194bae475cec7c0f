"""Dynamic batches on a real replica: a blocker of another size runs alone while the
compatible requests queue behind it, so the driver joins them into one pipeline call
(the replica needs ``--max-batch`` at least their images)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dpserve.contract import protocol as p
from tests.workers import WorkerProcess


def batched(
    worker: WorkerProcess, blocker: dict[str, Any], requests: dict[str, dict[str, Any]]
) -> dict[str, list[bytes]]:
    """Each request's images, by id; asserts they shared one call (one inference time)."""
    with worker.client(timeout_s=120) as client:
        client.send_raw(p.encode(p.GENERATE, "blocker", blocker))
        for request_id, body in requests.items():
            client.send_raw(p.encode(p.GENERATE, request_id, body))
        replies = {m.id: m for m in (client.recv() for _ in range(1 + len(requests)))}
    assert all(m.kind == p.RESULT for m in replies.values()), [m.body for m in replies.values()]
    results = {k: m.body_as(p.GenerateResult) for k, m in replies.items() if k != "blocker"}
    assert len({r.inference_time_s for r in results.values()}) == 1, results
    return {k: list(replies[k].blobs) for k in results}


def compatible_batch(
    request: dict[str, Any], owls: str = "two owls on a branch"
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """A blocker of another width, and three requests that join one call behind it:
    prompts of different lengths (``owls`` the longest), one of them with two images."""
    blocker = {**request, "width": 128, "num_inference_steps": 8, "seed": [1]}
    return blocker, {
        "fox": {**request, "seed": [7]},
        "owls": {**request, "prompt": owls, "n": 2, "seed": [8, 9]},
        "sea": {**request, "prompt": "the sea", "seed": [10]},
    }


def assert_batches_match(
    single: WorkerProcess,
    split: WorkerProcess,
    request: dict[str, Any],
    close: Callable[[bytes, bytes], bool],
    owls: str = "two owls on a branch",
) -> None:
    """The split replica's batch gives one rank's images (``close``), request by request."""
    blocker, requests = compatible_batch(request, owls)
    mine, theirs = batched(split, blocker, requests), batched(single, blocker, requests)
    for request_id, files in theirs.items():
        assert len(mine[request_id]) == len(files)
        assert all(map(close, mine[request_id], files)), request_id
