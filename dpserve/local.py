"""Embedded mode: N replicas as local processes and the router in front.

``dpserve serve --dp-size N`` is SGLang's ``--dp-size`` on one machine: replica
``r``'s driver binds ``scheduler_port + r``, or a free port when that one is taken
(the worker reports the endpoint it bound, and the router dials that one, as SGLang
settles its scheduler ports); a replica that dies is started again on the same
endpoint (as a pod's restart policy would), and the router brings it to the desired
control state before it takes traffic.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import TYPE_CHECKING

from dpserve.banner import ModelFacts, Ready, banner
from dpserve.client import ReplicaClient, ReplicaTimeout
from dpserve.config.worker import worker_flags
from dpserve.contract.layout import replica_endpoint
from dpserve.contract.model_info import ModelInfoError
from dpserve.contract.model_info import decode as decode_model_info
from dpserve.contract.protocol import (
    RequestError,
)
from dpserve.plumbing.curve import WireKey
from dpserve.plumbing.ports import free_port
from dpserve.plumbing.proc import die_with_parent

if TYPE_CHECKING:
    import uvicorn
    from fastapi import FastAPI

    from dpserve.router.app import RouterSettings

log = logging.getLogger("dpserve.serve")
# A replica that ran this long before it exited starts again after the shortest
# backoff, as a pod's restart backoff resets after it ran cleanly for a while.
_HEALTHY_RUN_S = 120.0


def _worker_preexec() -> None:
    # SIGTERM, not SIGKILL: a replica orphaned by a killed `serve` still drains.
    die_with_parent(signal.SIGTERM)


class WorkerProcess:
    """One replica (``dpserve worker``) as a child process.

    With ``settle``, a taken ``port`` moves to a free one: the worker writes the
    endpoint it bound to a file (``--endpoint-file``), and ``port`` and ``endpoint``
    are the real ones once ``wait_ready`` returns. A restart asks for that endpoint
    and no other, since its clients already dial it (taken: that start fails, and
    the next one tries again).

    ``wire_key_file``: the service key the worker serves under; this object's own
    clients (``wait_ready``, ``client``) hold it too.
    """

    def __init__(
        self,
        model: Path,
        *args: str,
        port: int | None = None,
        wait: bool = True,
        ready_timeout_s: float = 180.0,
        settle: bool = False,
        wire_key_file: Path | None = None,
    ) -> None:
        self.model = model
        self.args = args
        self.wire_key_file = wire_key_file
        self.key = None if wire_key_file is None else WireKey.load(wire_key_file)
        self.port = port or free_port()
        self.endpoint = replica_endpoint("127.0.0.1", self.port, 0)
        # Where the worker reports its endpoint (removed at exit, read or not).
        self._report = tempfile.TemporaryDirectory(prefix="dpserve-endpoint-") if settle else None
        self.proc = self._spawn()
        if wait:
            self.wait_ready(ready_timeout_s)

    @property
    def _endpoint_file(self) -> Path | None:
        return None if self._report is None else Path(self._report.name) / "endpoint"

    def _spawn(self) -> subprocess.Popen[bytes]:
        where = {
            "model": self.model,
            "port": self.port,
            "endpoint_file": self._endpoint_file,
            "wire_key_file": self.wire_key_file,
        }
        cmd = [sys.executable, "-m", "dpserve", "worker", *worker_flags(where), *self.args]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        return subprocess.Popen(cmd, env=env, preexec_fn=_worker_preexec)

    def restart(self) -> None:
        self.proc = self._spawn()

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        deadline = time.monotonic() + timeout_s
        if self._report is not None:
            self._settle(deadline)
        with ReplicaClient(self.endpoint, key=self.key) as client:
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

    def _settle(self, deadline: float) -> None:
        """Wait for the endpoint the worker bound; from then on, it is this worker's."""
        assert self._report is not None and self._endpoint_file is not None
        try:
            while not self._endpoint_file.is_file():
                if self.proc.poll() is not None:
                    raise RuntimeError(f"worker exited with {self.proc.returncode} during start-up")
                if time.monotonic() > deadline:
                    self.kill()
                    raise TimeoutError(f"worker for port {self.port} reported no endpoint in time")
                time.sleep(0.1)
            bound = self._endpoint_file.read_text().strip()
        finally:
            self._report.cleanup()
            self._report = None  # restarts ask for this endpoint, and only for it
        self.port = int(bound.rsplit(":", 1)[1])
        self.endpoint = replica_endpoint("127.0.0.1", self.port, 0)

    def client(self, timeout_s: float = 120.0) -> ReplicaClient:
        return ReplicaClient(self.endpoint, timeout_s=timeout_s, key=self.key)

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
    wire_key_file: Path | None = None  # the service key every replica serves under

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
        began = time.monotonic()
        c = self.config
        log.info(
            "starting %d replica(s) of %s, a gang of %d rank(s) each; each logs its "
            "start-up (imports, load, warm-up) as replica<r>/rank0",
            c.dp_size,
            c.model,
            c.gang_size,
        )
        for r in range(self.config.dp_size):
            port = self.config.scheduler_port + r
            args = self.config.replica_args(r)
            worker = WorkerProcess(
                self.config.model,
                *args,
                port=port,
                wait=False,
                settle=True,
                wire_key_file=self.config.wire_key_file,
            )
            self.workers.append(worker)
        try:
            for r, worker in enumerate(self.workers):  # they start in parallel; each in turn
                worker.wait_ready(ready_timeout_s)
                took = time.monotonic() - began
                log.info("replica %d answers on %s %.1fs after the start", r, worker.endpoint, took)
        except BaseException:
            self.stop()
            raise
        self._watcher.start()

    def _watch(self) -> None:
        backoff = dict.fromkeys(range(len(self.workers)), 1.0)
        started = dict.fromkeys(range(len(self.workers)), time.monotonic())
        while not self._stopping.wait(0.5):
            for r, worker in enumerate(self.workers):
                if worker.proc.poll() is None or self._stopping.is_set():
                    continue
                if time.monotonic() - started[r] > _HEALTHY_RUN_S:
                    backoff[r] = 1.0  # it ran fine for a while: not a crash loop
                log.warning(
                    "replica %d exited with %s; restarting it on %s in %.0fs",
                    r,
                    worker.proc.returncode,
                    worker.endpoint,
                    backoff[r],
                )
                if self._stopping.wait(backoff[r]):
                    return
                worker.restart()
                started[r] = time.monotonic()
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
    cache = Path(os.environ.get("DPSERVE_CACHE", Path.home() / ".cache" / "dpserve"))
    path = cache / "models" / "tiny-seed0"
    if (path / "model_index.json").is_file():
        return path  # no torch in this process: the replicas import it, not serve
    log.info("building the tiny model into %s (once)", path)
    from dpserve.worker.tiny_model import build_tiny_pipeline

    build_tiny_pipeline(path, variant="tiny", seed=0)
    return path


def serve(
    replicas: ReplicaSetConfig,
    sockets: list[socket.socket],
    host: str,
    port: int,
    settings: RouterSettings,
) -> int:
    """Start the replicas, then the router on ``sockets`` (``host:port``, bound by the
    caller before anything slow); stop everything on Ctrl-C or SIGTERM."""
    import asyncio

    import uvicorn

    from dpserve.router.app import create_app, server_config

    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"

    began = time.monotonic()

    async def run(
        app: FastAPI, server: uvicorn.Server, endpoints: list[str], model: ModelFacts
    ) -> None:
        async def announce() -> None:
            while not server.started:
                await asyncio.sleep(0.05)
            # The router's own first pings may still be under way on a busy machine:
            # the banner's calls must not meet a 503 "no replica serves".
            deadline = time.monotonic() + 60
            while _serving(app) < replicas.dp_size and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            keyed = bool(settings.api_keys or settings.admin_keys)
            took = time.monotonic() - began
            ready = Ready(url, replicas.dp_size, str(replicas.model), endpoints, keyed, took)
            print(banner(ready, model), flush=True)

        announcer = asyncio.create_task(announce())
        try:
            await server.serve(sockets=sockets)
        finally:
            announcer.cancel()

    _unwind_on_signals()
    keys = tempfile.TemporaryDirectory(prefix="dpserve-wire-")  # mode 0700: this user's
    key_file = replicas.wire_key_file
    if key_file is None:
        # A fresh key for this run: only this process's router can reach its replicas.
        key_file = Path(keys.name) / "wire.key"
        WireKey.generate().write(key_file)
        replicas = dataclasses.replace(replicas, wire_key_file=key_file)
    pool = dataclasses.replace(settings.pool, wire_key=WireKey.load(key_file))
    settings = dataclasses.replace(settings, pool=pool)
    local = LocalReplicas(replicas)
    try:
        local.start()
        settings = dataclasses.replace(settings, workers=tuple(local.endpoints), public_url=url)
        app = create_app(settings)
        server = uvicorn.Server(server_config(app, host, port, settings))
        log.info("router listening on %s", url)
        asyncio.run(run(app, server, local.endpoints, _model_facts(local.workers[0])))
    except _Stopped:
        pass  # asked to stop: what follows is the stop
    finally:
        # Already stopping. A second Ctrl-C still works: it reaches the workers too
        # (one process group), and they take it as "now".
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        local.stop()
        keys.cleanup()
        for sock in sockets:
            sock.close()
    return 0


class _Stopped(BaseException):
    """SIGINT or SIGTERM reached ``serve``: unwind to the orderly stop."""


def _unwind_on_signals() -> None:
    """SIGINT and SIGTERM raise ``_Stopped``: no KeyboardInterrupt traceback.

    Needed twice: while the replicas start, and when uvicorn, which handles both
    signals while it serves, re-raises the one it caught on its way out; by default
    that re-raise ends the process before the replicas are stopped, leaving them
    to drain orphaned.
    """

    def unwind(signum: int, frame: FrameType | None) -> None:
        raise _Stopped(signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, unwind)


def _serving(app: FastAPI) -> int:
    running = getattr(app.state, "running", None)  # set by the app's lifespan
    return 0 if running is None else len(running.pool.serving())


def _model_facts(worker: WorkerProcess) -> ModelFacts:
    """What the banner's examples depend on, from a replica's own model_info."""
    try:
        with worker.client(timeout_s=10.0) as client:
            return ModelFacts.of(decode_model_info(client.control("model_info")))
    # A replica that just died, or an answer this version cannot read: no examples.
    except (ReplicaTimeout, RequestError, ModelInfoError) as exc:
        log.warning("replica 0 did not say what it serves (%s): the banner shows no examples", exc)
        return ModelFacts()
