"""A real replica gang on gloo: CFG-parallel bytes, driver-only ingress, all-or-nothing."""

from __future__ import annotations

import io
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
from PIL import Image

from dpserve.contract.protocol import (
    GenerateResult,
    PingResult,
    RequestError,
)
from tests.polling import eventually
from tests.workers import WorkerProcess, ranks

pytestmark = pytest.mark.gang

CFG_REQUEST = dict(
    prompt="a red fox in the snow",
    negative_prompt="blurry, low quality",
    true_cfg_scale=4.0,
    width=64,
    height=64,
    num_inference_steps=4,
    seed=[7, 8],
    n=2,
)
PLAIN_REQUEST = dict(prompt="a lighthouse", width=64, height=64, num_inference_steps=3, seed=3)


@pytest.fixture(scope="module")
def cfg2(tiny_model: Path) -> WorkerProcess:
    with WorkerProcess(tiny_model, "--cfg", "2") as worker:
        yield worker


@pytest.fixture(scope="module")
def cfg1(tiny_model: Path) -> WorkerProcess:
    with WorkerProcess(tiny_model) as worker:
        yield worker


def _taken(ping: PingResult) -> int:
    """Requests the driver has taken so far: served, running or queued."""
    return ping.served + int(ping.busy) + ping.queue_depth


def _pixels(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png))).astype(np.int16)


def _generate(
    worker: WorkerProcess, request: dict[str, object]
) -> tuple[GenerateResult, list[bytes]]:
    with worker.client() as client:
        return client.generate(**request)


def test_cfg_parallel_png_equals_single_process(cfg1: WorkerProcess, cfg2: WorkerProcess) -> None:
    _one, one_png = _generate(cfg1, CFG_REQUEST)
    two, two_png = _generate(cfg2, CFG_REQUEST)
    assert len(two_png) == 2 and all(b.startswith(b"\x89PNG") for b in two_png)
    assert two_png == one_png
    assert [m.seed for m in two.images] == [7, 8]
    assert two_png[0] != two_png[1]  # two seeds, two different images
    with cfg2.client() as client:
        info = client.control("model_info")
    assert info["cfg_parallel"] == "split" and info["gang_size"] == 2


def test_cfg_gang_without_true_cfg_splits_the_tokens_instead(
    cfg1: WorkerProcess, cfg2: WorkerProcess
) -> None:
    """No second branch to run: the CFG ranks split the sequence (Ulysses over two), so the
    image matches one rank's within float rounding (the latents: test_parallel_math)."""
    _, (one_png,) = _generate(cfg1, PLAIN_REQUEST)
    result, (two_png,) = _generate(cfg2, PLAIN_REQUEST)
    diff = np.abs(_pixels(two_png) - _pixels(one_png)).max()
    assert diff <= 1
    assert result.replica == 0 and result.peak_memory_mb > 0 and result.inference_time_s > 0
    with cfg2.client() as client:
        lent = client.control("model_info")["without_true_cfg"]
        assert lent == "lent to sequence parallel (ulysses)"  # 2 heads: one per CFG rank


def test_only_the_driver_binds_zmq(cfg2: WorkerProcess) -> None:
    rank_procs = ranks(cfg2)
    assert len(rank_procs) == 2
    listeners = {
        r.pid
        for r in rank_procs
        for c in r.net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == cfg2.port
    }
    assert listeners == {rank_procs[0].pid}
    # The other rank never even loads libzmq: it cannot bind a ZMQ socket.
    maps = Path(f"/proc/{rank_procs[1].pid}/maps").read_text()
    assert "libzmq" not in maps
    assert "libzmq" in Path(f"/proc/{rank_procs[0].pid}/maps").read_text()


def test_bad_request_names_fields_and_replica_keeps_serving(cfg2: WorkerProcess) -> None:
    with cfg2.client() as client:
        with pytest.raises(RequestError) as err:
            client.generate(prompt="x", width=65, num_inference_steps=0, n=11)
        assert err.value.code == "invalid_request"
        assert {f.field for f in err.value.fields} == {"width", "num_inference_steps", "n"}
        assert client.ping().status == "ok"


def test_killed_rank_takes_the_gang_down(tiny_model: Path) -> None:
    worker = WorkerProcess(tiny_model, "--cfg", "2")
    try:
        rank_procs = ranks(worker)
        os.kill(rank_procs[1].pid, signal.SIGKILL)
        started = time.monotonic()
        code = worker.proc.wait(timeout=30)
        elapsed = time.monotonic() - started
        assert code != 0
        assert elapsed < 10
        assert not any(r.is_running() and r.status() != psutil.STATUS_ZOMBIE for r in rank_procs)
    finally:
        worker.kill()


def test_a_killed_supervisor_leaves_no_process_behind(tiny_model: Path) -> None:
    """SIGKILL the supervisor: its ranks (named ``dpserve-rankN``) and the fork server a
    CPU gang starts them from go with it, whoever holds whose pipes."""
    worker = WorkerProcess(tiny_model, "--cfg", "2")
    try:
        rank_procs = ranks(worker)
        assert [r.name() for r in rank_procs] == ["dpserve-rank0", "dpserve-rank1"]
        everything = psutil.Process(worker.proc.pid).children(recursive=True)
        worker.proc.send_signal(signal.SIGKILL)
        _, alive = psutil.wait_procs(everything, timeout=15)
        assert not alive, [(p.pid, p.name()) for p in alive]
    finally:
        worker.kill()


def test_sigterm_finishes_in_flight_requests_and_exits_zero(tiny_model: Path) -> None:
    worker = WorkerProcess(tiny_model, "--cfg", "2")
    results: list[object] = []

    def call() -> None:
        with worker.client() as client:
            try:
                results.append(client.generate(**{**CFG_REQUEST, "num_inference_steps": 30}))
            except Exception as exc:  # recorded and asserted below
                results.append(exc)

    callers = [threading.Thread(target=call) for _ in range(3)]
    try:
        with worker.client() as pinger:
            served = pinger.ping().served
            for t in callers:
                t.start()
            eventually(  # the three requests reached the driver: queued, running or served
                lambda: _taken(pinger.ping()) - served >= 3, timeout_s=30, poll_s=0.02
            )
        worker.proc.send_signal(signal.SIGTERM)
        for t in callers:
            t.join(timeout=120)
        assert worker.proc.wait(timeout=60) == 0
        assert len(results) == 3
        assert all(isinstance(r, tuple) for r in results), results
    finally:
        worker.kill()


def test_cuda_without_a_gpu_is_refused_before_any_rank_starts(tiny_model: Path) -> None:
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "dpserve", "worker", "--model", str(tiny_model)]
    cmd += ["--port", "1", "--device", "cuda", "--cfg", "2"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "no CUDA device is visible" in done.stderr
    assert "started" not in done.stderr  # no rank was spawned
