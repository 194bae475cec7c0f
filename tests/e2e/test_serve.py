"""The seed's acceptance: `dpserve serve --dp-size N` serves N requests at once."""

from __future__ import annotations

import base64
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest

from dpserve.worker.paths import REFUSED
from tests.polling import eventually
from tests.readme_examples import run_readme_example
from tests.servers import ServeProcess, assert_all_answered
from tests.workers import gang_ranks

pytestmark = pytest.mark.e2e

REQUEST = {"prompt": "a paper boat", "size": "64x64", "num_inference_steps": 3, "seed": 42}


# The name `make serve` (serve without --model) gives its model, which the README uses.
SERVED = "tiny-seed0"


@pytest.fixture(scope="module")
def dp2(tiny_model: Path, allow_tmp: tuple[str, str]) -> Iterator[ServeProcess]:
    with ServeProcess(tiny_model, 2, *allow_tmp, "--served-model-name", SERVED) as serve:
        yield serve


def _image(response: httpx.Response) -> bytes:
    assert response.status_code == 200, response.text
    return base64.b64decode(response.json()["data"][0]["b64_json"])


def test_each_replica_binds_its_own_driver_port(dp2: ServeProcess) -> None:
    for r in range(2):
        supervisor = dp2.replica_supervisor(r)
        listening = {
            c.laddr.port
            for child in gang_ranks(supervisor)
            for c in child.net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN
        }
        assert dp2.scheduler_port + r in listening


def test_same_seed_same_bytes_on_both_replicas_and_dp1(dp2: ServeProcess, tiny_model: Path) -> None:
    first = dp2.http.post("/v1/images/generations", json=REQUEST)
    second = dp2.http.post("/v1/images/generations", json=REQUEST)
    replicas = {first.headers["X-Dpserve-Replica"], second.headers["X-Dpserve-Replica"]}
    assert replicas == {"0", "1"}  # round-robin: every replica serves, replica 1 included
    assert _image(first) == _image(second)
    assert first.json()["data"][0]["seed"] == 42
    # dp1 also runs with keys: `serve` passes them to its router (the same bytes, keyed).
    keys = ("--api-key", API_KEY, "--admin-key", ADMIN_KEY)
    with ServeProcess(tiny_model, 1, *keys) as dp1:
        _keys_are_checked(dp1)
        keyed = dp1.http.post("/v1/images/generations", json=REQUEST, headers=_bearer(API_KEY))
        assert _image(keyed) == _image(first)


API_KEY, ADMIN_KEY = "sk-e2e-inference", "sk-e2e-admin"


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _keys_are_checked(serve: ServeProcess) -> None:
    """Over real HTTP (uvicorn): 401 without a key, 403 for an inference key on control
    routes, and the realtime WebSocket refused at its upgrade."""
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    missing = serve.http.post("/v1/images/generations", json=REQUEST)
    assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
    assert "Authorization: Bearer <key>" in missing.json()["error"]["message"]
    assert serve.http.get("/v1/list_loras", headers=_bearer(API_KEY)).status_code == 403
    assert serve.http.get("/v1/list_loras", headers=_bearer(ADMIN_KEY)).status_code == 200
    info = serve.http.get("/server_info", headers=_bearer(ADMIN_KEY))
    assert info.status_code == 200 and API_KEY not in info.text and ADMIN_KEY not in info.text
    ws = f"ws://127.0.0.1:{serve.port}/v1/realtime_video/generate"
    with pytest.raises(InvalidStatus) as refused, connect(ws):
        pass
    assert refused.value.response.status_code == 401
    with connect(ws, additional_headers=_bearer(API_KEY)):
        pass  # accepted


def test_concurrent_pair_runs_on_both_replicas(dp2: ServeProcess) -> None:
    slow = {**REQUEST, "size": "256x256", "num_inference_steps": 12}
    with ThreadPoolExecutor(2) as pool:
        responses = list(
            pool.map(lambda _: dp2.http.post("/v1/images/generations", json=slow), range(2))
        )
    assert {r.headers["X-Dpserve-Replica"] for r in responses} == {"0", "1"}
    assert all(r.status_code == 200 for r in responses)


def test_openai_client_works_unchanged(dp2: ServeProcess) -> None:
    import openai
    from openai import OpenAI

    client = OpenAI(base_url=f"{dp2.url}/v1", api_key="unused")
    out = client.images.generate(
        model=SERVED,
        prompt="a kite",
        n=2,
        size="64x64",  # type: ignore[arg-type]
        response_format="b64_json",
        extra_body={"seed": 5, "num_inference_steps": 2},
    )
    assert len(out.data) == 2
    pngs = [base64.b64decode(d.b64_json or "") for d in out.data]
    assert all(p.startswith(b"\x89PNG") for p in pngs) and pngs[0] != pngs[1]
    assert [m.id for m in client.models.list().data] == [SERVED]
    assert client.models.retrieve(SERVED).created > 0
    with pytest.raises(openai.NotFoundError) as refused:
        client.images.generate(model="tiny", prompt="a kite", size="64x64")  # type: ignore[arg-type]
    assert refused.value.code == "model_not_found" and refused.value.param == "model"


def test_control_fan_out_reaches_every_replica(dp2: ServeProcess, tiny_lora: Path) -> None:
    base = _image(dp2.http.post("/v1/images/generations", json=REQUEST))
    # Missing or outside the allowed folders: one 400, the same words, nothing applied.
    refusals = []
    for path in ("/missing", "/etc", f"{tiny_lora}/../../.."):
        bad = dp2.http.post("/v1/set_lora", json={"lora_nickname": "s", "lora_path": path})
        assert bad.status_code == 400
        assert [r["ok"] for r in bad.json()["replicas"]] == [False, False]
        assert bad.json()["control_state"]["applied"] is False
        refusals.append(bad.json()["message"].split(": ", 1)[1])
    assert refusals == [f"lora_path {REFUSED}"] * 3
    ok = dp2.http.post("/v1/set_lora", json={"lora_nickname": "s", "lora_path": str(tiny_lora)})
    assert ok.status_code == 200, ok.text
    assert len(ok.json()["replicas"]) == 2
    listed = dp2.http.get("/v1/list_loras").json()
    assert listed["consistent"] is True
    assert listed["result"]["loaded"] == [{"nickname": "s", "path": str(tiny_lora)}]
    sums = dp2.http.get("/get_weights_checksum").json()
    assert sums["consistent"] is True and len(sums["replicas"]) == 2
    with_lora = [_image(dp2.http.post("/v1/images/generations", json=REQUEST)) for _ in range(2)]
    assert with_lora[0] == with_lora[1] != base
    off = dp2.http.post("/v1/set_lora", json={"lora_nickname": "s", "strength": 0.0})
    assert off.status_code == 200
    assert _image(dp2.http.post("/v1/images/generations", json=REQUEST)) == base


def test_bad_input_gets_4xx_and_the_router_stays_up(dp2: ServeProcess) -> None:
    post = dp2.http.post
    cases = [
        post(
            "/v1/images/generations",
            content=b"{not json",
            headers={"content-type": "application/json"},
        ),
        post("/v1/images/generations", json=["a list"]),
        post("/v1/images/generations", json={"prompt": 5}),
        post("/v1/images/generations", json={"prompt": "x", "size": "65x64"}),
        post("/v1/images/generations", json={"prompt": "x", "num_inference_steps": 10_000}),
        post("/v1/images/generations", json={"prompt": "x", "n": 0}),
        post("/v1/images/generations", json={"prompt": "x", "response_format": "url"}),
        post("/v1/images/generations", content=b"x" * (2 << 20)),
        post("/v1/no_such_route", json={}),
        dp2.http.get("/v1/images/generations"),
        post("/v1/set_lora", content=b"[1,2]", headers={"content-type": "application/json"}),
    ]
    statuses = [r.status_code for r in cases]
    assert statuses == [400, 400, 400, 400, 400, 400, 400, 413, 404, 405, 400]
    for response in cases:
        assert response.json()["error"]["message"]
    assert cases[3].json()["error"]["param"] == "size"
    assert "output store" in cases[6].json()["error"]["message"]
    assert dp2.http.get("/ready").status_code == 200


def test_metrics_and_info(dp2: ServeProcess) -> None:
    dp2.http.post("/v1/images/generations", json=REQUEST)
    text = dp2.http.get("/metrics").text
    assert (
        'dpserve_requests_total{method="POST",route="/v1/images/generations",status="200"}' in text
    )
    assert "dpserve_replica_serving" in text and "dpserve_queue_depth" in text
    assert "dpserve_replica_realtime_sessions" in text
    info = dp2.http.get("/server_info").json()
    assert info["replicas"] == 2 and info["serving"] == 2
    assert info["layout"] == "tp1-sp1(u1r1)-cfg1-dp2" and info["threads_per_rank"] == 1
    assert dp2.http.get("/model_info").json()["pipeline_class"] == "FluxPipeline"


def test_readme_realtime_example_runs(dp2: ServeProcess) -> None:
    scope = run_readme_example(dp2.port, "realtime_video")
    assert scope["msg"] == {"type": "done", "session_id": scope["msg"]["session_id"], "frames": 10}
    assert scope["png"].startswith(b"\x89PNG")


def test_readme_openai_example_runs(
    dp2: ServeProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from PIL import Image

    monkeypatch.chdir(tmp_path)  # an empty folder: the example makes in.png and mask.png
    scope = run_readme_example(dp2.port, "client.images.generate")
    assert scope["event"].type == "image_generation.completed"
    with Image.open(tmp_path / "in.png") as image, Image.open(tmp_path / "mask.png") as mask:
        assert (image.format, image.size, mask.size) == ("PNG", (256, 256), (256, 256))
        assert {value for _, value in mask.getcolors()} == {0, 255}  # black: keep; white: repaint
    edit = scope["edit"]
    assert edit.size == "256x256"
    assert base64.b64decode(edit.data[0].b64_json) != (tmp_path / "in.png").read_bytes()


class _Load:
    """Clients generating without pause; what each got (replica or error) and how long."""

    def __init__(self, serve: ServeProcess, clients: int = 3, replicas: int = 2) -> None:
        self.url = serve.url
        self.replica_names = {str(r) for r in range(replicas)}
        self.served: list[tuple[str, float, float]] = []  # replica, start, end
        self.failures: list[str] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._client) for _ in range(clients)]

    def __enter__(self) -> _Load:
        for t in self.threads:
            t.start()
        self.served_by_all()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=120)

    def _client(self) -> None:
        with httpx.Client(base_url=self.url, timeout=120) as client:
            while not self.stop.is_set():
                start = time.monotonic()
                r = client.post("/v1/images/generations", json={**REQUEST, "size": "128x128"})
                if r.status_code == 200:
                    replica = r.headers["X-Dpserve-Replica"]
                    self.served.append((replica, start, time.monotonic()))
                else:
                    self.failures.append(r.text)

    def replicas(self) -> list[str]:
        return [replica for replica, _, _ in self.served]

    def served_by_all(self, since: int = 0, timeout_s: float = 60) -> None:
        """Until every replica has answered one of the requests from ``since`` on."""
        eventually(lambda: self.replica_names <= set(self.replicas()[since:]), timeout_s)


def _failed_over(serve: ServeProcess, name: str) -> bool:
    """The router has replica ``name`` out of rotation, with nothing in flight there."""
    replicas = serve.http.get("/health/replicas").json()["replicas"]
    (replica,) = [r for r in replicas if r["replica"] == name]
    return replica["state"] != "serving" and replica["in_flight"] == 0


def test_killed_replica_costs_latency_not_requests(dp2: ServeProcess, tiny_lora: Path) -> None:
    dp2.http.post("/v1/set_lora", json={"lora_nickname": "k", "lora_path": str(tiny_lora)})
    with _Load(dp2) as load:
        victim = dp2.replica_supervisor(1)
        for proc in [victim, *victim.children(recursive=True)]:
            proc.kill()
        saw_unhealthy = False
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not saw_unhealthy:
            saw_unhealthy = dp2.http.get("/health").status_code == 503
            assert dp2.http.get("/ready").status_code == 200
            time.sleep(0.1)
        assert saw_unhealthy
        dp2.wait_healthy(120)  # restarted by serve, brought to the desired control state
        load.served_by_all(since=len(load.served))  # the restarted one serves the load too
    assert load.failures == []
    assert load.replicas().count("1") >= 1 and load.replicas().count("0") >= 1
    assert_all_answered(dp2.http)
    listed = dp2.http.get("/v1/list_loras").json()
    assert listed["consistent"] is True
    assert "k" in [x["nickname"] for x in listed["result"]["loaded"]]
    pngs = {
        r.headers["X-Dpserve-Replica"]: _image(r)
        for r in (dp2.http.post("/v1/images/generations", json=REQUEST) for _ in range(2))
    }
    assert set(pngs) == {"0", "1"} and pngs["0"] == pngs["1"]


def test_stopped_driver_costs_seconds_not_requests(dp2: ServeProcess) -> None:
    """SIGSTOP a driver under load: what it held is retried on the other replica after
    two missed pings (seconds, not the request timeout); SIGCONT: it serves again."""
    driver = gang_ranks(dp2.replica_supervisor(0))[0]
    with _Load(dp2) as load:
        stopped = time.monotonic()
        driver.suspend()
        # Resumed once the router took it out and moved what it held elsewhere, which
        # must come before the supervisor's 10 s hang timeout would restart the gang.
        eventually(lambda: _failed_over(dp2, "0"), timeout_s=9, poll_s=0.1)
        driver.resume()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and load.replicas()[-6:].count("0") < 2:
            time.sleep(0.2)  # back in rotation after a good ping
    assert load.failures == []
    held = [end - start for _, start, end in load.served if start <= stopped <= end]
    assert held and max(held) < 10, held
    assert load.replicas()[-6:].count("0") >= 2
    assert_all_answered(dp2.http)


def test_serve_with_sequence_and_tensor_parallel_replicas(tiny4_model: Path) -> None:
    """serve --tp 2 --sp 2: the HTTP journey on a gang that splits weights and tokens."""
    args = ("--tp", "2", "--sp", "2", "--max-sequence-length", "64")
    with ServeProcess(tiny4_model, 1, *args) as serve:
        done = serve.http.post("/v1/images/generations", json={**REQUEST, "size": "64x64"})
        assert done.status_code == 200, done.text
        assert done.json()["data"][0]["b64_json"]
        info = serve.http.get("/server_info").json()
        assert info["layout"] == "tp2-sp2(u2r1)-cfg1-dp1"
        weights = info["rank_weights"]
        assert [(w["tp_rank"], w["sp_rank"]) for w in weights] == [(0, 0), (1, 0), (0, 1), (1, 1)]
        pieces = {w["bytes"]["transformer"] for w in weights}
        assert len(pieces) == 1  # the same share of the transformer on every rank
        bad = serve.http.post("/v1/images/generations", json={**REQUEST, "size": "80x48"})
        assert bad.status_code == 400
        error = bad.json()["error"]
        assert error["param"] == "size" and "multiple of 2" in error["message"]
