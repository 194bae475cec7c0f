"""Embedded mode: N replicas as local processes and the router in front.

``dpserve serve --dp-size N`` is SGLang's ``--dp-size`` on one machine: replica
``r``'s driver binds ``scheduler_port + r``; a replica that dies is started again
on the same port (as a pod's restart policy would), and the router replays the
control log to it before it takes traffic.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from dpserve.client import ReplicaClient, ReplicaTimeout
from dpserve.layout import replica_endpoint
from dpserve.proc import die_with_parent
from dpserve.worker.config import worker_flags

if TYPE_CHECKING:
    from dpserve.router.app import RouterSettings

log = logging.getLogger("dpserve.serve")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker_preexec() -> None:
    # SIGTERM, not SIGKILL: a replica orphaned by a killed `serve` still drains.
    die_with_parent(signal.SIGTERM)


class WorkerProcess:
    """One replica (``dpserve worker``) as a child process."""

    def __init__(
        self,
        model: Path,
        *args: str,
        port: int | None = None,
        wait: bool = True,
        ready_timeout_s: float = 180.0,
    ) -> None:
        self.model = model
        self.args = args
        self.port = port or free_port()
        self.endpoint = replica_endpoint("127.0.0.1", self.port, 0)
        self.proc = self._spawn()
        if wait:
            self.wait_ready(ready_timeout_s)

    def _spawn(self) -> subprocess.Popen[bytes]:
        cmd = [sys.executable, "-m", "dpserve", "worker"]
        cmd += [*worker_flags({"model": self.model, "port": self.port}), *self.args]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        return subprocess.Popen(cmd, env=env, preexec_fn=_worker_preexec)

    def restart(self) -> None:
        self.proc = self._spawn()

    def wait_ready(self, timeout_s: float = 180.0) -> None:
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
        self.kill()
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


@dataclass(frozen=True)
class ReplicaSetConfig:
    model: Path
    dp_size: int
    scheduler_port: int = 5575
    worker_args: tuple[str, ...] = ()  # the gang options every replica shares, as flags
    gang_size: int = 1

    def replica_args(self, replica: int) -> tuple[str, ...]:
        """Replica r's worker flags: its index, and its own block of GPUs (as the
        rank layout's blocks), so replicas never share a GPU."""
        own = {"replica": replica, "first_gpu": replica * self.gang_size}
        return (*self.worker_args, *worker_flags(own))


class LocalReplicas:
    """``dp_size`` workers, kept alive: one that exits is started again with backoff."""

    def __init__(self, config: ReplicaSetConfig) -> None:
        self.config = config
        self.workers: list[WorkerProcess] = []
        self._stopping = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="replica-watch", daemon=True)

    @property
    def endpoints(self) -> list[str]:
        return [w.endpoint for w in self.workers]

    def start(self, ready_timeout_s: float = 300.0) -> None:
        for r in range(self.config.dp_size):
            port = self.config.scheduler_port + r
            args = self.config.replica_args(r)
            self.workers.append(WorkerProcess(self.config.model, *args, port=port, wait=False))
        try:
            for worker in self.workers:  # they start in parallel; wait for each in turn
                worker.wait_ready(ready_timeout_s)
        except BaseException:
            self.stop()
            raise
        self._watcher.start()

    def _watch(self) -> None:
        backoff = dict.fromkeys(range(len(self.workers)), 1.0)
        while not self._stopping.wait(0.5):
            for r, worker in enumerate(self.workers):
                if worker.proc.poll() is None or self._stopping.is_set():
                    continue
                log.warning(
                    "replica %d exited with %s; restarting in %.0fs",
                    r,
                    worker.proc.returncode,
                    backoff[r],
                )
                if self._stopping.wait(backoff[r]):
                    return
                worker.restart()
                backoff[r] = min(backoff[r] * 2, 30.0)

    def stop(self, timeout_s: float = 60.0) -> None:
        """SIGTERM every replica (they drain), then make sure none is left."""
        self._stopping.set()
        for worker in self.workers:
            if worker.proc.poll() is None:
                worker.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for worker in self.workers:
            try:
                worker.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                worker.kill()


def default_model() -> Path:
    """The tiny model, built once into the user's cache."""
    from dpserve.worker.tiny_model import build_tiny_pipeline

    cache = Path(os.environ.get("DPSERVE_CACHE", Path.home() / ".cache" / "dpserve"))
    path = cache / "models" / "tiny-seed0"
    if not (path / "model_index.json").is_file():
        log.info("building the tiny model into %s", path)
        build_tiny_pipeline(path, variant="tiny", seed=0)
    return path


def serve(replicas: ReplicaSetConfig, host: str, port: int, settings: RouterSettings) -> int:
    """Start the replicas, then the router; stop everything on Ctrl-C or SIGTERM."""
    import asyncio

    import uvicorn

    from dpserve.router.app import create_app, server_config

    local = LocalReplicas(replicas)
    local.start()
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
    settings = dataclasses.replace(settings, workers=tuple(local.endpoints), public_url=url)
    server = uvicorn.Server(server_config(create_app(settings), host, port))

    async def announce() -> None:
        while not server.started:
            await asyncio.sleep(0.05)
        print(_banner(url, replicas), flush=True)

    async def run() -> None:
        announcer = asyncio.create_task(announce())
        try:
            await server.serve()
        finally:
            announcer.cancel()

    try:
        asyncio.run(run())
    finally:
        local.stop()
    return 0


def _banner(url: str, replicas: ReplicaSetConfig) -> str:
    return (
        f"\ndpserve ready: {replicas.dp_size} replica(s) of {replicas.model} behind {url}\n"
        f"  drivers on tcp://127.0.0.1:{replicas.scheduler_port}"
        f"..{replicas.scheduler_port + replicas.dp_size - 1}\n"
        "  try:\n"
        f"    curl -s {url}/v1/images/generations -H 'Content-Type: application/json' \\\n"
        '      -d \'{"prompt": "a lighthouse at dusk", "size": "256x256", '
        '"num_inference_steps": 8, "seed": 1}\' | head -c 300; echo\n'
        f"    curl -s {url}/health/replicas\n"
        f"  realtime sessions: {url.replace('http', 'ws', 1)}/v1/realtime_video/generate"
        " (docs/realtime.md)\n"
        "  Ctrl-C stops everything.\n"
    )
