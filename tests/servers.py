"""`dpserve serve` as a child process of a test, with an HTTP client on it."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

import httpx
import psutil

from dpserve.client import ReplicaClient
from dpserve.plumbing.curve import WireKey
from tests.workers import free_port


class ServeProcess:
    def __init__(
        self,
        model: Path | str,
        dp_size: int,
        *args: str,
        timeout_s: float = 180.0,
        log: Path | None = None,
    ) -> None:
        self.port = free_port()
        self.scheduler_port = free_port() + 0  # replicas bind scheduler_port + r
        while any(_taken(self.scheduler_port + r) for r in range(dp_size)):
            self.scheduler_port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "dpserve", "serve", "--model", str(model)]
        cmd += ["--dp-size", str(dp_size), "--port", str(self.port)]
        cmd += ["--scheduler-port", str(self.scheduler_port), *args]
        if log is None:
            self.proc = subprocess.Popen(cmd)
        else:  # a benchmark keeps its own output to its figures
            with log.open("ab") as out:
                self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        self.http = httpx.Client(base_url=self.url, timeout=120)
        try:
            self.wait_healthy(timeout_s)
        except BaseException:
            self.close()
            raise

    def wait_healthy(self, timeout_s: float = 120.0) -> None:
        """Until every replica is in rotation. ``/health`` alone is not that: it answers 200
        once every replica answers pings, and the router puts a replica in rotation only
        after its model_info, read after that first ping (a busy machine answers it late,
        and a request in between is a 503)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve exited with {self.proc.returncode}")
            try:
                if self.http.get("/health").status_code == 200 and _all_serving(self.http):
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"{self.url} not healthy in {timeout_s:.0f}s")

    def replica_supervisor(self, replica: int) -> psutil.Process:
        for child in psutil.Process(self.proc.pid).children():
            cmd = child.cmdline()
            if "worker" in cmd and cmd[cmd.index("--replica") + 1] == str(replica):
                return child
        raise LookupError(f"no worker process for replica {replica}")

    def driver(self, replica: int = 0, timeout_s: float = 10) -> ReplicaClient:
        """A wire client of a replica's driver, with the key serve gave it."""
        cmd = self.replica_supervisor(replica).cmdline()
        key = WireKey.load(Path(cmd[cmd.index("--wire-key-file") + 1]))
        endpoint = f"tcp://127.0.0.1:{self.scheduler_port + replica}"
        return ReplicaClient(endpoint, timeout_s=timeout_s, key=key)

    def close(self) -> int:
        self.http.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _taken(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def assert_all_answered(http: httpx.Client) -> dict[str, int]:
    """The router's books balance: every request it took got one answer; by outcome."""
    from dpserve.router.metrics import read_accounting

    books = read_accounting(http.get("/metrics").text)
    assert books.unanswered == 0, books
    return books.answered


class RouterProcess:
    """`dpserve router` over given replica endpoints, ready once /ready answers 200."""

    def __init__(
        self, workers: list[str], *args: str, timeout_s: float = 60.0, log: Path | None = None
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "dpserve", "router", "--port", str(self.port), *args]
        for worker in workers:
            cmd += ["--worker", worker]
        if log is None:
            self.proc = subprocess.Popen(cmd)
        else:  # a benchmark keeps its own output to its figures
            with log.open("ab") as out:
                self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        self.http = httpx.Client(base_url=self.url, timeout=120)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if self.http.get("/ready").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.close()
                raise RuntimeError("router did not become ready")
            time.sleep(0.2)

    def close(self) -> None:
        self.http.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> RouterProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _all_serving(http: httpx.Client) -> bool:
    """``/ready`` counts every replica as serving (it is open, like ``/health``)."""
    ready = http.get("/ready")
    shown = ready.json() if ready.status_code == 200 else {}
    return bool(shown.get("replicas")) and shown.get("serving") == shown.get("replicas")
