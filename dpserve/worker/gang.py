"""The supervisor of one replica: starts its gang of ranks and keeps it all-or-nothing.

A rank that dies, or stops sending heartbeats (stopped, frozen: ``heartbeat``), takes
the whole gang down with a non-zero exit, so a replica is never half alive. SIGTERM
(or Ctrl-C) asks the driver to drain: it stops taking requests, finishes the queued
ones and relays STOP, and every rank exits 0.
"""

from __future__ import annotations

import dataclasses
import glob
import logging
import multiprocessing as mp
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Sequence
from multiprocessing.context import ForkServerContext, SpawnContext
from multiprocessing.process import BaseProcess
from types import FrameType

from dpserve.config.worker import WorkerConfig
from dpserve.worker.gpus import gang_first_gpu, gpu_problem
from dpserve.worker.heartbeat import HangCheck, Heartbeats
from dpserve.worker.rank import RankArgs, rank_main
from dpserve.worker.splittable import layout_problem

log = logging.getLogger("dpserve.worker")
_POLL_S = 0.2


def _rank_env(threads: int) -> None:
    """Environment the spawned ranks inherit, set before they import torch."""
    # OpenMP/MKL pools size themselves at import time.
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(threads)
    # Ranks of a gang share one host: keep gloo's transport on loopback.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # Models load from local folders only; a hub lookup would hang without network.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    for var in ("DIFFUSERS_VERBOSITY", "TRANSFORMERS_VERBOSITY"):
        os.environ.setdefault(var, "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def _kill(procs: Sequence[BaseProcess]) -> None:
    for proc in procs:
        if proc.is_alive() and proc.pid is not None:
            os.kill(proc.pid, signal.SIGKILL)
    for proc in procs:
        proc.join(timeout=5)


def _gpus_visible(device: str) -> int:
    if device == "cpu" or (device == "auto" and not glob.glob("/dev/nvidia[0-9]*")):
        return 0
    import torch  # only where GPUs may be: a CPU machine's supervisor stays light

    return torch.cuda.device_count()  # through NVML: no CUDA context in this process


def _context(gang_size: int, on_gpus: bool) -> SpawnContext | ForkServerContext:
    """How the ranks start. A CPU gang forks them from one server process that imported
    torch, diffusers and transformers once (``preload``): the gang pays those imports
    once, not once per rank. GPU ranks are spawned fresh, since a process that touched
    the CUDA driver (the libraries may ask it for devices at import) cannot fork
    children that use it; so is a gang of one, which has nothing to share."""
    if on_gpus or gang_size == 1:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["dpserve.worker.preload"])
    return ctx


def run_gang(cfg: WorkerConfig) -> int:
    """Run the replica until it is stopped; the return value is the process's exit code."""
    cfg.parallel.validate()
    problem = layout_problem(cfg.model, cfg.parallel, cfg.max_sequence_length)
    if problem is not None:
        log.error("replica %d: %s", cfg.replica, problem)
        return 2
    visible = _gpus_visible(cfg.device)
    problem = gpu_problem(cfg.device, cfg.gang_size, visible)
    if problem is not None:
        log.error("replica %d: %s", cfg.replica, problem)
        return 2
    if visible and cfg.device != "cpu":
        first = gang_first_gpu(cfg.first_gpu, cfg.gang_size, visible)
        if first != cfg.first_gpu:
            log.warning(
                "replica %d: GPUs %d.. are not visible; sharing GPUs %d..%d with another replica",
                cfg.replica,
                cfg.first_gpu,
                first,
                first + cfg.gang_size - 1,
            )
        cfg = dataclasses.replace(cfg, first_gpu=first)
    _rank_env(cfg.threads_per_rank)
    ctx = _context(cfg.gang_size, on_gpus=bool(visible) and cfg.device != "cpu")
    store_dir = tempfile.mkdtemp(prefix="dpserve-gang-")
    store = os.path.join(store_dir, "store")
    beats = Heartbeats(ctx, cfg.gang_size)
    procs = [
        ctx.Process(
            target=rank_main,
            args=(RankArgs(cfg, rank, store, beats),),
            name=f"dpserve-r{cfg.replica}-rank{rank}",
        )
        for rank in range(cfg.gang_size)
    ]
    stop_at: list[float] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if stop_at:
            if signum == signal.SIGINT:  # a second Ctrl-C means now
                log.warning("second interrupt: killing the gang")
                stop_at[0] = 0.0
            return
        log.info("signal %d: draining replica %d", signum, cfg.replica)
        stop_at.append(time.monotonic() + cfg.drain_timeout_s)
        driver = procs[0]
        if driver.is_alive() and driver.pid is not None:
            os.kill(driver.pid, signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        for rank, proc in enumerate(procs):
            beats.started(rank)
            proc.start()
        log.info("replica %d: started %d ranks", cfg.replica, len(procs))
        return _watch(procs, stop_at, HangCheck(beats, cfg.hang_timeout_s, time.monotonic()))
    finally:
        _kill(procs)
        shutil.rmtree(store_dir, ignore_errors=True)


def _watch(procs: Sequence[BaseProcess], stop_at: list[float], hangs: HangCheck) -> int:
    """Poll the ranks: any failure or hang kills the gang; all clean exits end it with 0."""
    while True:
        codes = [proc.exitcode for proc in procs]
        failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            rank, code = failed[0]
            log.error("rank %d exited with %s: stopping the whole gang", rank, code)
            _kill(procs)
            return 1
        hung = hangs.hung([r for r, c in enumerate(codes) if c is None], time.monotonic())
        if hung is not None:
            rank, silent = hung
            log.error(
                "rank %d (%s) sent no heartbeat for %.1fs: stopping the whole gang",
                rank,
                _state(procs[rank].pid),
                silent,
            )
            _kill(procs)
            return 1
        if all(c == 0 for c in codes):
            log.info("all ranks stopped cleanly")
            return 0
        if any(c == 0 for c in codes) and not stop_at:
            # A rank that quits on its own is as fatal as a crash, but give the
            # others a moment: after a STOP they exit within a poll or two.
            stop_at.append(time.monotonic() + 10)
        if stop_at and time.monotonic() > stop_at[0]:
            log.error("gang did not stop in time: killing it")
            _kill(procs)
            return 1
        time.sleep(_POLL_S)


def _state(pid: int | None) -> str:
    """What Linux says a process is doing, for the log: "stopped" names a SIGSTOP."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            letter = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"
    names = {"T": "stopped", "t": "stopped by a tracer", "D": "in an uninterruptible wait"}
    return names.get(letter, f"state {letter}")
