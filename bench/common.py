"""Shared pieces of the benchmarks: cached models, CPU-share sampling, medians."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import psutil

from dpserve.local import WorkerProcess

T = TypeVar("T")
CACHE = Path(os.environ.get("DPSERVE_CACHE", Path.home() / ".cache" / "dpserve"))


def cached_model(variant: str, seed: int = 0) -> Path:
    from dpserve.worker.tiny_model import build_tiny_pipeline

    path = CACHE / "models" / f"{variant}-seed{seed}"
    if not (path / "model_index.json").is_file():
        build_tiny_pipeline(path, variant=variant, seed=seed)
    return path


def rank_processes(worker: WorkerProcess) -> list[psutil.Process]:
    children = psutil.Process(worker.proc.pid).children()
    return [c for c in children if "spawn_main" in " ".join(c.cmdline())]


def _machine_busy() -> float:
    t = psutil.cpu_times()
    return t.user + t.nice + t.system + t.irq + t.softirq + getattr(t, "steal", 0.0)


def _own_cpu(procs: list[psutil.Process]) -> float:
    total = 0.0
    for proc in procs:
        try:
            times = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def timed_round(procs: list[psutil.Process], call: Callable[[], T]) -> tuple[float, float, T]:
    """Wall time of ``call`` and the CPU (in cores) that others used meanwhile.

    "Others" is every process but ``procs`` and this one, plus hypervisor steal:
    a noisy neighbour. Ranks legitimately idle while they wait on a collective,
    so their own CPU share says little; the neighbours' share says whether the
    round measured the code or the machine.
    """
    mine = [*procs, psutil.Process()]
    busy0, own0 = _machine_busy(), _own_cpu(mine)
    start = time.perf_counter()
    result = call()
    wall = time.perf_counter() - start
    busy1, own1 = _machine_busy(), _own_cpu(mine)
    foreign = max(0.0, (busy1 - busy0) - (own1 - own0)) / wall
    return wall, foreign, result


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")
