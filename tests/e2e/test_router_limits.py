"""Router limits against a real replica: 429 when full, disconnects free the queue, URLs."""

from __future__ import annotations

import base64
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.polling import eventually
from tests.servers import RouterProcess
from tests.workers import WorkerProcess

pytestmark = pytest.mark.e2e

SLOW = {"prompt": "a slow one", "size": "512x512", "num_inference_steps": 40, "seed": 1}
FAST = {"prompt": "a quick one", "size": "64x64", "num_inference_steps": 2, "seed": 2}


@pytest.fixture(scope="module")
def worker(tiny_model: Path) -> Iterator[WorkerProcess]:
    with WorkerProcess(tiny_model) as w:
        yield w


@pytest.fixture(scope="module")
def router(
    worker: WorkerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RouterProcess]:
    out = tmp_path_factory.mktemp("images")
    args = ["--max-inflight-per-replica", "1", "--max-waiting", "1", "--output-dir", str(out)]
    with RouterProcess([worker.endpoint], *args) as r:
        yield r


def _served(worker: WorkerProcess) -> int:
    with worker.client() as client:
        return client.ping().served


def _in_flight(router: RouterProcess) -> int:
    return int(router.http.get("/health/replicas").json()["replicas"][0]["in_flight"])


def test_full_queue_answers_429_with_retry_after(router: RouterProcess) -> None:
    def post(_: int) -> httpx.Response:
        with httpx.Client(base_url=router.url, timeout=120) as c:
            return c.post("/v1/images/generations", json=SLOW)

    with ThreadPoolExecutor(5) as pool:
        responses = list(pool.map(post, range(5)))
    statuses = sorted(r.status_code for r in responses)
    assert statuses.count(200) >= 2  # one running, one waiting
    limited = [r for r in responses if r.status_code == 429]
    assert limited and all(r.headers["Retry-After"] for r in limited)
    assert "busy" in limited[0].json()["error"]["message"]


def test_client_that_goes_away_frees_its_queue_slot(
    router: RouterProcess, worker: WorkerProcess
) -> None:
    before = _served(worker)
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(router.http.post, "/v1/images/generations", json=SLOW)
        eventually(lambda: _in_flight(router) == 1, timeout_s=30, poll_s=0.02)  # the only slot
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{router.url}/v1/images/generations", json=FAST, timeout=0.5)
        deadline = time.monotonic() + 5
        while (
            router.http.get("/health/replicas").json()["queue_depth"]
            and time.monotonic() < deadline
        ):
            time.sleep(0.05)
        assert router.http.get("/health/replicas").json()["queue_depth"] == 0
        assert running.result().status_code == 200
    # A later request, queued behind anything the router still meant to send: served
    # once it is, so the abandoned one would have been served by now had it been sent.
    assert router.http.post("/v1/images/generations", json=FAST).status_code == 200
    assert _served(worker) == before + 2  # the abandoned request never reached the replica


def test_url_response_format_with_an_output_store(router: RouterProcess) -> None:
    as_url = router.http.post("/v1/images/generations", json={**FAST, "response_format": "url"})
    assert as_url.status_code == 200, as_url.text
    url = as_url.json()["data"][0]["url"]
    fetched = httpx.get(url)
    assert fetched.status_code == 200
    inline = router.http.post("/v1/images/generations", json=FAST).json()["data"][0]["b64_json"]
    assert fetched.content == base64.b64decode(inline)
    assert router.http.get("/v1/images/files/..%2Fetc%2Fpasswd").status_code == 404
