"""`dpserve serve` settles its replicas' ports: a taken `scheduler_port + r` moves replica
r to a free port, the router dials the one it bound, a restart keeps it, and stopping
`serve` prints no interpreter-shutdown noise."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from tests.polling import eventually
from tests.workers import free_port

pytestmark = pytest.mark.e2e

REQUEST = {"prompt": "a harbour", "size": "64x64", "num_inference_steps": 2, "seed": 4}
NOISE = ("leaked semaphore", "resource_tracker", "Exception ignored", "Traceback")


def _free_pair() -> int:
    """A port p with p + 1 free as well."""
    while True:
        port = free_port()
        if port < 65535 and all(_free(p) for p in (port, port + 1)):
            return port


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _replicas(http: httpx.Client) -> list[dict[str, Any]]:
    return sorted(http.get("/health/replicas").json()["replicas"], key=lambda r: r["endpoint"])


def _both_serve(http: httpx.Client) -> set[str]:
    served = set()
    for _ in range(4):  # round-robin: two requests would do, unless one replica is catching up
        response = http.post("/v1/images/generations", json=REQUEST)
        assert response.status_code == 200, response.text
        served.add(response.headers["X-Dpserve-Replica"])
    return served


def _supervisor(serve: subprocess.Popen[bytes], replica: int) -> psutil.Process:
    for child in psutil.Process(serve.pid).children():
        cmd = child.cmdline()
        if "worker" in cmd and cmd[cmd.index("--replica") + 1] == str(replica):
            return child
    raise LookupError(f"no worker process for replica {replica}")


def test_a_taken_scheduler_port_moves_the_replica_and_the_router_follows(
    tiny_model: Path, tmp_path: Path
) -> None:
    scheduler, port = _free_pair(), free_port()
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", scheduler + 1))
    squatter.listen()
    cmd = [sys.executable, "-m", "dpserve", "serve", "--model", str(tiny_model)]
    cmd += ["--dp-size", "2", "--port", str(port), "--scheduler-port", str(scheduler)]
    log = tmp_path / "stderr"
    with log.open("wb") as err:
        serve = subprocess.Popen(cmd, stderr=err)
    http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120)
    try:
        eventually(lambda: http.get("/health").status_code == 200, 300, "serve to be healthy")
        endpoints = [r["endpoint"] for r in _replicas(http)]
        moved = next(e for e in endpoints if not e.endswith(f":{scheduler}"))
        assert f"tcp://127.0.0.1:{scheduler}" in endpoints
        assert not moved.endswith(f":{scheduler + 1}")
        assert _both_serve(http) == {"0", "1"}

        # Freed now, the asked port must not tempt the restarted replica: the router
        # dials the one it settled on.
        squatter.close()
        _supervisor(serve, 1).kill()

        def states() -> dict[str, str]:
            return {r["endpoint"]: r["state"] for r in _replicas(http)}

        eventually(lambda: states()[moved] != "serving", 30, "the router to see replica 1 go")

        def back_where_it_was() -> bool:
            replicas = _replicas(http)
            return [r["endpoint"] for r in replicas] == endpoints and all(
                r["state"] == "serving" for r in replicas
            )

        eventually(back_where_it_was, 240, "replica 1 back on its endpoint")
        assert _both_serve(http) == {"0", "1"}
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=120) == 0
    finally:
        squatter.close()
        http.close()
        if serve.poll() is None:
            serve.kill()
            serve.wait()
    lines = log.read_text().splitlines()
    assert any(f"port {scheduler + 1} is taken; bound {moved} instead" in line for line in lines)
    assert [line for line in lines if any(n in line for n in NOISE)] == []
