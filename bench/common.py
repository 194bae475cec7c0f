"""Shared pieces of the benchmarks: cached models, model flags, requests, CPU-share sampling,
medians."""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import httpx
import psutil

from dpserve.local import WorkerProcess
from tests.workers import gang_ranks

T = TypeVar("T")
CACHE = Path(os.environ.get("DPSERVE_CACHE", Path.home() / ".cache" / "dpserve"))


def cached_model(variant: str, seed: int = 0) -> Path:
    from dpserve.worker.tiny_model import build_tiny_pipeline

    path = CACHE / "models" / f"{variant}-seed{seed}"
    if not (path / "model_index.json").is_file():
        build_tiny_pipeline(path, variant=variant, seed=seed)
    return path


def add_model_args(parser: argparse.ArgumentParser, *, steps: int, rounds: int) -> None:
    """The flags of a bench that runs its own replicas of one model: which model, where and
    in what dtype, the request's size and steps, the timed rounds, the prompt's tokens."""
    parser.add_argument("--model", type=Path, help="a model folder (default: --variant's)")
    parser.add_argument("--variant", default="small", choices=("tiny", "small"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--max-sequence-length", type=int, default=77)


def model_and_flags(args: argparse.Namespace) -> tuple[Path, list[str]]:
    """The model folder and the worker flags that :func:`add_model_args`' flags chose."""
    flags = ["--device", args.device, "--dtype", args.dtype]
    flags += ["--max-sequence-length", str(args.max_sequence_length)]
    return args.model or cached_model(args.variant), flags


def one_request(size: int, steps: int) -> dict[str, object]:
    """The benchmarks' request: one square image, fixed prompt and seed."""
    return {
        "prompt": "a watercolor lighthouse at dusk",
        "width": size,
        "height": size,
        "num_inference_steps": steps,
        "seed": 1234,
    }


def true_cfg_request(size: int, steps: int) -> dict[str, object]:
    """The benchmarks' request with true CFG (two guidance branches a step), fixed seed."""
    return {
        **one_request(size, steps),
        "negative_prompt": "blurry, low quality",
        "true_cfg_scale": 4.0,
    }


def cached_lora(model: Path, seed: int = 0) -> Path:
    from dpserve.worker.tiny_model import build_tiny_lora

    path = model.parent / f"{model.name}-lora-seed{seed}"
    if not path.is_dir():
        build_tiny_lora(path, model, seed=seed)
    return path


def wait_ready(
    url: str, timeout_s: float = 60, proc: subprocess.Popen[bytes] | None = None
) -> None:
    """Until the router at ``url`` answers /ready with 200 (or ``proc`` exits)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and (proc is None or proc.poll() is None):
        try:
            if httpx.get(f"{url}/ready").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"router {url} not ready")


def rank_processes(worker: WorkerProcess) -> list[psutil.Process]:
    return gang_ranks(psutil.Process(worker.proc.pid))


def _machine_busy() -> float:
    t = psutil.cpu_times()
    return t.user + t.nice + t.system + t.irq + t.softirq + getattr(t, "steal", 0.0)


def cpu_seconds(procs: list[psutil.Process]) -> float:
    """User and system CPU seconds of ``procs`` so far (those gone count nothing)."""
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
    busy0, own0 = _machine_busy(), cpu_seconds(mine)
    start = time.perf_counter()
    result = call()
    wall = time.perf_counter() - start
    busy1, own1 = _machine_busy(), cpu_seconds(mine)
    foreign = max(0.0, (busy1 - busy0) - (own1 - own0)) / wall
    return wall, foreign, result


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def connection_cap(clients: int) -> int:
    """The router's --max-connections for a load of ``clients``: the limit counts every
    open connection, and a load turn's closed ones still count until the server has
    seen them go, so the next turn's clients arrive while the last turn's linger."""
    return 2 * clients + 64


def connection_flags(clients: int) -> list[str]:
    """The router's connection caps for a load of ``clients``, all from this one
    address (so its per-address cap is the whole)."""
    cap = str(connection_cap(clients))
    return ["--max-connections", cap, "--max-connections-per-peer", cap]
