"""Round-robin vs least-work routing under a mixed open-loop load, one run, same arrivals.

`dpserve serve --dp-size 2` (its router routes by least work) and a second
`dpserve router --policy round_robin` over the same two replicas (the same wire key).
First the capacity is measured: closed-loop, ``2 x max-inflight`` clients draw the
mix for ``--capacity-requests`` requests. Then one arrival sequence is drawn:
Poisson at ``--load`` of that capacity, 80 % small requests (64x64, 4 steps) and 20 %
large (256x256, 16 steps), and replayed open-loop through each router in turn
(alternating which goes first over ``--rounds``). Latency is from a request's
scheduled arrival to its answer. Each phase records the CPU each process group used
and the cores other processes took (``bench.common.timed_round``); a phase where
others took more than ``--max-foreign`` cores is flagged NOISY (a noisy neighbour
halves throughput on this machine) and its figures are still printed.
Last line: ``rr_p99_s=<a> lw_p99_s=<b> p99_gain=<a/b> tput_gain=<c>``.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import cached_model, cpu_seconds, timed_round, wait_ready
from dpserve.plumbing.curve import WireKey
from dpserve.plumbing.ports import free_port

SMALL = {"size": "64x64", "num_inference_steps": 4}
LARGE = {"size": "256x256", "num_inference_steps": 16}
LARGE_SHARE = 0.2


@dataclass(frozen=True)
class Arrival:
    at: float  # seconds after the phase starts
    large: bool
    seed: int


@dataclass(frozen=True)
class Phase:
    policy: str
    latencies: list[tuple[bool, float]]  # (large, seconds)
    span_s: float  # first arrival to last answer
    foreign: float  # cores other processes used meanwhile
    cpu_s: dict[str, float]  # CPU seconds per process group

    @property
    def throughput(self) -> float:
        return len(self.latencies) / self.span_s


def body(large: bool, seed: int) -> dict[str, object]:
    return {"prompt": "a harbour at dawn", "seed": seed, **(LARGE if large else SMALL)}


def arrivals(rate: float, count: int, seed: int) -> list[Arrival]:
    rng = random.Random(seed)
    at, out = 0.0, []
    for i in range(count):
        at += rng.expovariate(rate)
        out.append(Arrival(at, rng.random() < LARGE_SHARE, i))
    return out


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (no interpolation: with few samples, a real latency)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


async def replay(url: str, plan: list[Arrival]) -> tuple[list[tuple[bool, float]], float]:
    """Each request sent at its time, whatever the others do (open loop)."""
    limits = httpx.Limits(max_connections=len(plan) + 8)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        start = time.perf_counter()

        async def one(a: Arrival) -> tuple[bool, float, float]:
            await asyncio.sleep(max(0.0, start + a.at - time.perf_counter()))
            response = await http.post("/v1/images/generations", json=body(a.large, a.seed))
            response.raise_for_status()
            done = time.perf_counter() - start
            return a.large, done - a.at, done

        results = await asyncio.gather(*(one(a) for a in plan))
    return [(large, latency) for large, latency, _ in results], max(r[2] for r in results)


def capacity(url: str, clients: int, requests: int, seed: int) -> float:
    """Requests per second the pair completes when never idle (closed loop, the mix)."""
    rng = random.Random(seed)
    kinds = [rng.random() < LARGE_SHARE for _ in range(requests)]
    with httpx.Client(base_url=url, timeout=600) as http, ThreadPoolExecutor(clients) as pool:
        start = time.perf_counter()
        list(pool.map(lambda k: http.post("/v1/images/generations", json=body(k, 1)), kinds))
        return requests / (time.perf_counter() - start)


class Stack:
    """`dpserve serve --dp-size 2` (least work) and a round-robin router beside it."""

    def __init__(self, model: Path, inflight: int, workdir: Path) -> None:
        key = workdir / "wire.key"
        WireKey.generate().write(key)
        common = ["--max-inflight-per-replica", str(inflight), "--wire-key-file", str(key)]
        port = free_port()
        serve = [sys.executable, "-m", "dpserve", "serve", "--model", str(model)]
        serve += ["--dp-size", "2", "--port", str(port), "--scheduler-port", str(free_port())]
        serve += ["--threads-per-rank", "1", "--max-sequence-length", "77"]
        serve += ["--policy", "least_work", *common]
        quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
        self.serve = subprocess.Popen(serve, **quiet)  # type: ignore[call-overload]
        self.urls = {"least_work": f"http://127.0.0.1:{port}"}
        self.router: subprocess.Popen[bytes] | None = None
        wait_ready(self.urls["least_work"], 300, self.serve)
        replicas = httpx.get(f"{self.urls['least_work']}/health/replicas").json()["replicas"]
        rr_port = free_port()
        router = [sys.executable, "-m", "dpserve", "router", "--port", str(rr_port)]
        for replica in replicas:
            router += ["--worker", replica["endpoint"]]
        router += ["--policy", "round_robin", *common]
        self.router = subprocess.Popen(router, **quiet)  # type: ignore[call-overload]
        self.urls["round_robin"] = f"http://127.0.0.1:{rr_port}"
        wait_ready(self.urls["round_robin"], 60, self.router)

    def groups(self) -> dict[str, list[psutil.Process]]:
        serve = psutil.Process(self.serve.pid)
        workers = serve.children(recursive=True)  # supervisors and ranks; the router is serve
        assert self.router is not None
        return {
            "replicas": workers,
            "serve_router": [serve],
            "rr_router": [psutil.Process(self.router.pid)],
        }

    def close(self) -> None:
        for proc in (self.router, self.serve):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=120)


def run_phase(stack: Stack, policy: str, plan: list[Arrival]) -> Phase:
    groups = stack.groups()
    before = {name: cpu_seconds(procs) for name, procs in groups.items()}
    everyone = [proc for procs in groups.values() for proc in procs]
    _, foreign, (latencies, span) = timed_round(
        everyone, lambda: asyncio.run(replay(stack.urls[policy], plan))
    )
    cpu = {name: cpu_seconds(procs) - before[name] for name, procs in groups.items()}
    return Phase(policy, latencies, span, foreign, cpu)


def summary(phases: list[Phase], policy: str) -> tuple[float, float, float]:
    mine = [p for p in phases if p.policy == policy]
    every = [s for p in mine for _, s in p.latencies]
    small = [s for p in mine for large, s in p.latencies if not large]
    large = [s for p in mine for big, s in p.latencies if big]
    tput = sum(len(p.latencies) for p in mine) / sum(p.span_s for p in mine)
    p50, p99 = percentile(every, 0.5), percentile(every, 0.99)
    print(
        f"{policy}: p50={p50:.2f}s p99={p99:.2f}s throughput={tput:.3f}/s | "
        f"small p50={percentile(small, 0.5):.2f}s p99={percentile(small, 0.99):.2f}s | "
        f"large p50={percentile(large, 0.5):.2f}s p99={percentile(large, 0.99):.2f}s"
    )
    return p50, p99, tput


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--variant", default="small", choices=("tiny", "small"))
    parser.add_argument("--requests", type=int, default=200, help="arrivals per phase")
    parser.add_argument("--rounds", type=int, default=1, help="phases per policy")
    parser.add_argument("--load", type=float, default=0.7, help="share of measured capacity")
    parser.add_argument("--capacity-requests", type=int, default=40)
    parser.add_argument("--max-inflight-per-replica", type=int, default=2)
    parser.add_argument("--max-foreign", type=float, default=0.25, help="cores, then NOISY")
    parser.add_argument("--seed", type=int, default=15)
    args = parser.parse_args()
    model = cached_model(args.variant)
    with tempfile.TemporaryDirectory(prefix="dpserve-mixed-") as tmp:
        stack = Stack(model, args.max_inflight_per_replica, Path(tmp))
        try:
            for url in stack.urls.values():  # warm the HTTP paths; calibrate the replicas
                for large in (False, True, False, False, True, False):
                    httpx.post(f"{url}/v1/images/generations", json=body(large, 0), timeout=600)
            clients = 2 * args.max_inflight_per_replica
            cap = capacity(stack.urls["least_work"], clients, args.capacity_requests, args.seed)
            rate = args.load * cap
            print(f"capacity={cap:.3f}/s (closed loop, {clients} clients); offered={rate:.3f}/s")
            plan = arrivals(rate, args.requests, args.seed)
            phases: list[Phase] = []
            for round_ in range(args.rounds):
                order = ["round_robin", "least_work"]
                for policy in order if round_ % 2 == 0 else order[::-1]:
                    phase = run_phase(stack, policy, plan)
                    phases.append(phase)
                    noisy = " NOISY" if phase.foreign > args.max_foreign else ""
                    cpu = " ".join(f"{k}={v / phase.span_s:.2f}" for k, v in phase.cpu_s.items())
                    print(
                        f"round {round_} {policy}: span={phase.span_s:.1f}s "
                        f"throughput={phase.throughput:.3f}/s cpu_cores[{cpu}] "
                        f"foreign_cores={phase.foreign:.2f}{noisy}",
                        flush=True,
                    )
        finally:
            stack.close()
    print(
        f"model={args.variant} small={SMALL} large={LARGE} large_share={LARGE_SHARE} "
        f"load={args.load} requests={args.requests} rounds={args.rounds} "
        f"max_inflight_per_replica={args.max_inflight_per_replica}"
    )
    noisy = sum(p.foreign > args.max_foreign for p in phases)
    print(f"phases flagged NOISY (other processes took > {args.max_foreign} cores): {noisy}")
    _, rr_p99, rr_tput = summary(phases, "round_robin")
    _, lw_p99, lw_tput = summary(phases, "least_work")
    print(
        f"rr_p99_s={rr_p99:.2f} lw_p99_s={lw_p99:.2f} "
        f"p99_gain={rr_p99 / lw_p99:.2f} tput_gain={lw_tput / rr_tput:.2f}"
    )


if __name__ == "__main__":
    main()
