"""Through the router over real HTTP: a client that leaves mid-render, and a request
timeout, free the replica for the next request at once (one slot per replica, so the
next request can only start once the replica has answered the first)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.servers import RouterProcess, assert_all_answered
from tests.workers import WorkerProcess

pytestmark = pytest.mark.e2e

LONG = {"prompt": "a long one", "size": "256x256", "num_inference_steps": 300, "seed": 5}
LONGER = {**LONG, "num_inference_steps": 1000}  # never rendered to the end
QUICK = {"prompt": "a quick one", "size": "64x64", "num_inference_steps": 2, "seed": 6}
ONE_SLOT = ("--max-inflight-per-replica", "1")


@pytest.fixture(scope="module")
def worker(tiny_model: Path) -> Iterator[WorkerProcess]:
    with WorkerProcess(tiny_model, "--max-steps", "1000") as w:
        yield w


@pytest.fixture(scope="module")
def full_render_s(worker: WorkerProcess) -> float:
    with worker.client() as client:
        start = time.monotonic()
        client.generate(**LONG)
        return time.monotonic() - start


def _replica_state(router: RouterProcess) -> tuple[str, int]:
    (replica,) = router.http.get("/health/replicas").json()["replicas"]
    return replica["state"], replica["in_flight"]


def test_a_client_that_leaves_mid_render_frees_the_replica(
    worker: WorkerProcess, full_render_s: float
) -> None:
    leave_s = min(0.5, full_render_s / 8)
    with RouterProcess([worker.endpoint], *ONE_SLOT) as router:
        start = time.monotonic()
        with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes its connection
            httpx.post(f"{router.url}/v1/images/generations", json=LONG, timeout=leave_s)
        quick = router.http.post("/v1/images/generations", json=QUICK)
        freed = time.monotonic() - start
        assert quick.status_code == 200, quick.text
        assert _replica_state(router) == ("serving", 0)  # a cancel is no replica failure
        assert assert_all_answered(router.http)["disconnected"] == 1
    print(
        f"\n[router, client left at {leave_s:.2f}s] next request done {freed:.2f}s after the "
        f"first was sent; full render {full_render_s:.2f}s: ratio {freed / full_render_s:.2f}"
    )
    assert freed < 0.5 * full_render_s


def test_the_request_timeout_reaches_the_replica_as_its_deadline(
    worker: WorkerProcess, full_render_s: float
) -> None:
    with RouterProcess([worker.endpoint], *ONE_SLOT, "--request-timeout", "1") as router:
        start = time.monotonic()
        late = router.http.post("/v1/images/generations", json=LONGER)
        answered = time.monotonic() - start
        assert late.status_code == 504, late.text
        assert "passed its deadline" in late.json()["error"]["message"]
        quick = router.http.post("/v1/images/generations", json=QUICK)
        freed = time.monotonic() - start
        assert quick.status_code == 200, quick.text
        assert _replica_state(router) == ("serving", 0)
        assert assert_all_answered(router.http)["server_error"] >= 1  # the 504
    print(
        f"\n[router, --request-timeout 1] 504 after {answered:.2f}s, next request done "
        f"{freed:.2f}s after the first was sent; the full render of a third of its steps "
        f"takes {full_render_s:.2f}s"
    )
    assert 1.0 <= answered < 2.5
    assert freed - answered < 1.0  # the slot was free when the 504 left
