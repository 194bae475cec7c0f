"""Dynamic batches on a real replica: a blocker of another size runs alone while the
compatible requests queue behind it, so the driver joins them into one pipeline call
(the replica needs ``--max-batch`` at least their images)."""

from __future__ import annotations

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
