"""Faults of a gang's processes: a stopped rank is found through the heartbeats and the
replica restarted; a stopped worker leaves no interpreter-shutdown noise."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from dpserve.client import ReplicaClient, ReplicaTimeout
from dpserve.contract.protocol import (
    PingResult,
)
from dpserve.local import LocalReplicas, ReplicaSetConfig
from tests.polling import eventually
from tests.workers import WorkerProcess, free_port, ranks

pytestmark = pytest.mark.gang

HANG_TIMEOUT_S = 4.0
# Detection takes the timeout plus up to one beat, one poll and a loaded machine's slack.
DETECTED_WITHIN_S = HANG_TIMEOUT_S + 4.0
GANG = ("--cfg", "2", "--hang-timeout", str(HANG_TIMEOUT_S), "--max-steps", "2000")
LONG_REQUEST = dict(
    prompt="a long night",
    negative_prompt="blurry",
    true_cfg_scale=3.0,
    width=64,
    height=64,
    num_inference_steps=2000,
    seed=1,
)
NOISE = ("leaked semaphore", "resource_tracker", "Exception ignored", "Traceback")


def _stop_rank_and_time_the_exit(worker: WorkerProcess, rank: int) -> float:
    supervisor, gang = worker.proc, ranks(worker)
    os.kill(gang[rank].pid, signal.SIGSTOP)
    stopped = time.monotonic()
    code = supervisor.wait(timeout=60)
    elapsed = time.monotonic() - stopped
    assert code == 1
    assert not any(r.is_running() and r.status() != psutil.STATUS_ZOMBIE for r in gang)
    print(f"rank {rank} stopped: gang down after {elapsed:.2f}s")
    return elapsed


def test_a_stopped_rank_of_an_idle_gang_takes_it_down(tiny_model: Path) -> None:
    worker = WorkerProcess(tiny_model, *GANG)
    try:
        assert _stop_rank_and_time_the_exit(worker, 1) < DETECTED_WITHIN_S
    finally:
        worker.kill()


def test_a_rank_stopped_during_a_generation_takes_the_gang_down(tiny_model: Path) -> None:
    worker = WorkerProcess(tiny_model, *GANG)
    outcome: list[object] = []

    def generate() -> None:
        with worker.client(timeout_s=60) as client:
            try:
                outcome.append(client.generate(**LONG_REQUEST))
            except Exception as exc:  # the gang dies under it: recorded, asserted below
                outcome.append(exc)

    caller = threading.Thread(target=generate, daemon=True)
    try:
        caller.start()
        with worker.client() as client:
            eventually(lambda: client.ping().busy, 30, "the generation to start")
        assert _stop_rank_and_time_the_exit(worker, 1) < DETECTED_WITHIN_S
        assert not any(isinstance(o, tuple) for o in outcome)  # it never finished
    finally:
        worker.kill()


def _ping(endpoint: str) -> PingResult | None:
    with ReplicaClient(endpoint) as client:
        try:
            return client.ping(timeout_s=1.0)
        except ReplicaTimeout:
            return None


def test_serve_restarts_a_replica_whose_rank_was_stopped(tiny_model: Path) -> None:
    config = ReplicaSetConfig(tiny_model, 1, free_port(), GANG, gang_size=2)
    local = LocalReplicas(config)
    local.start()
    try:
        worker = local.workers[0]
        first = _ping(worker.endpoint)
        assert first is not None and first.status == "ok"
        hung = worker.proc
        _stop_rank_and_time_the_exit(worker, 1)
        assert hung.returncode == 1

        def serving_again() -> bool:
            ping = _ping(worker.endpoint)
            return ping is not None and ping.status == "ok" and ping.boot_id != first.boot_id

        eventually(serving_again, 180, "the replica to come back")
        assert worker.proc is not hung and worker.proc.poll() is None
        with worker.client() as client:
            _, images = client.generate(prompt="back", width=64, height=64, seed=2)
        assert images and images[0].startswith(b"\x89PNG")
    finally:
        local.stop()


def test_a_stopped_worker_leaves_no_shutdown_noise(tiny_model: Path, tmp_path: Path) -> None:
    """SIGTERM after a generation: ranks leave by os._exit, and nothing may warn about
    what they left (the resource tracker once did, for each rank's semaphore)."""
    port = free_port()
    cmd = [sys.executable, "-m", "dpserve", "worker", "--model", str(tiny_model)]
    cmd += ["--port", str(port), "--cfg", "2"]
    log = tmp_path / "stderr"
    with log.open("wb") as err:
        proc = subprocess.Popen(cmd, stderr=err)
    try:
        endpoint = f"tcp://127.0.0.1:{port}"
        eventually(lambda: proc.poll() is None and _ping(endpoint), 180, "the worker")
        with ReplicaClient(endpoint) as client:
            client.generate(prompt="a bell", width=64, height=64, num_inference_steps=2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    lines = log.read_text().splitlines()
    assert any("all ranks stopped cleanly" in line for line in lines)
    assert [line for line in lines if any(n in line for n in NOISE)] == []


def test_a_taken_port_still_fails_a_worker_not_asked_to_settle(tiny_model: Path) -> None:
    """Kubernetes declares the port: without --endpoint-file a taken one is fatal."""
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        cmd = [sys.executable, "-m", "dpserve", "worker", "--model", str(tiny_model)]
        done = subprocess.run(
            [*cmd, "--port", str(port)], capture_output=True, text=True, timeout=300
        )
    assert done.returncode != 0
    assert f"port {port} is taken" in done.stderr, done.stderr
