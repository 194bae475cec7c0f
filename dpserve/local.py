"""Embedded mode: replicas as local processes (the router joins them with the next issue)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

from dpserve.client import ReplicaClient, ReplicaTimeout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class WorkerProcess:
    """One replica (``dpserve worker``) as a child process, ready once it answers a ping."""

    def __init__(
        self, model: Path, *args: str, port: int | None = None, ready_timeout_s: float = 180.0
    ) -> None:
        self.port = port or free_port()
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "dpserve", "worker", "--model", str(model)]
        cmd += ["--port", str(self.port), *args]
        self.proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            self._wait_ready(ready_timeout_s)
        except BaseException:
            self.kill()
            raise

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with ReplicaClient(self.endpoint) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"worker exited with {self.proc.returncode} during start-up")
                try:
                    client.ping(timeout_s=1.0)
                    return
                except ReplicaTimeout:
                    continue
        raise TimeoutError(f"worker on {self.endpoint} not ready in {timeout_s:.0f}s")

    def client(self, timeout_s: float = 120.0) -> ReplicaClient:
        return ReplicaClient(self.endpoint, timeout_s=timeout_s)

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM: the replica drains and exits; returns its exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout_s)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def __enter__(self) -> WorkerProcess:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            self.stop(timeout_s=30)
        except subprocess.TimeoutExpired:
            self.kill()
