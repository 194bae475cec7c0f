"""`dpserve serve` locks its wire: a key made at start-up, private, given to its
workers and its router, gone when it exits."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from dpserve.client import ReplicaClient, ReplicaTimeout
from dpserve.plumbing.curve import WireKey
from tests.servers import ServeProcess

pytestmark = pytest.mark.e2e

REQUEST = {"prompt": "a paper boat", "size": "64x64", "num_inference_steps": 1, "seed": 1}


def test_serve_makes_a_private_key_its_drivers_require(tiny_model: Path) -> None:
    with ServeProcess(tiny_model, 1) as serve:
        cmd = serve.replica_supervisor(0).cmdline()
        key_file = Path(cmd[cmd.index("--wire-key-file") + 1])
        assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
        assert stat.S_IMODE(key_file.parent.stat().st_mode) == 0o700
        key = WireKey.load(key_file)
        endpoint = f"tcp://127.0.0.1:{serve.scheduler_port}"
        with ReplicaClient(endpoint, timeout_s=2) as stranger, pytest.raises(ReplicaTimeout):
            stranger.ping()  # no key: nothing
        with ReplicaClient(endpoint, timeout_s=10, key=key) as holder:
            assert holder.ping().status == "ok"
        # The router holds the same key: it serves.
        done = serve.http.post("/v1/images/generations", json=REQUEST)
        assert done.status_code == 200, done.text
        assert serve.http.get("/server_info").json()["router"]["pool"]["wire_key"] == "curve"
    assert not key_file.parent.exists()
