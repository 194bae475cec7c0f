"""Soak: many concurrent clients through a real router for minutes; does it hold steady?

Backends: ``--drivers`` stub drivers (bench/stub_driver.py, real ZMQ drivers that
answer at once with a fixed PNG). The router is ``dpserve router`` (uvicorn) in a
process of its own, on real HTTP. ``--clients`` request loops (aiohttp, keep-alive,
``--timeout`` per request: the router's default) are spread over ``--client-procs``
processes so that the load generator is not what saturates first. Each loop posts
a generation, reads the answer, and again.

Warm-up: at least ``--warmup`` seconds, until every client loop holds its
connection and the router has taken 5 requests per client. Then, for
``--duration`` seconds under the same load, the router's RSS and open file
descriptors (``/proc/<pid>/status``, ``/proc/<pid>/fd``) are sampled at the start,
``--samples`` times in between, and at the end. The descriptors are also counted
idle, before the load and after the clients have gone: a connection the router
never closes shows there. Finally ``/metrics`` must balance: every request the
router accepted was answered (dpserve.router.metrics.read_accounting).

``requests`` counts the successes in the measured window; ``errors`` every failure,
warm-up included. The ``cpu`` line says how much of the machine the router got
(its event loop's runnable wait, from ``/proc/<pid>/schedstat``): on a shared
machine, latency is the neighbours' as much as the router's. Last line::

    soak clients=<n> duration_s=<s> requests=<n> errors=<n> rss_start_mb=<a>
    rss_end_mb=<b> rss_ratio=<b/a> fds_start=<c> fds_end=<d> fds_idle_before=<e>
    fds_idle_after=<f> accepted=<x> answered=<y>
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from multiprocessing import get_context
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import connection_flags, timed_round, wait_ready
from dpserve.plumbing.ports import free_port
from dpserve.router.metrics import Accounting, read_accounting

BODY = {"prompt": "x", "size": "64x64", "num_inference_steps": 1, "seed": 1}
HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Sample:
    t_s: float
    rss_mb: float
    fds: int
    accepted: int
    scrape_s: float  # how long /metrics took to answer, under the load


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise LookupError(f"no VmRSS for {pid}")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def scrape(url: str) -> Accounting:
    return read_accounting(httpx.get(f"{url}/metrics", timeout=300).text)


# ------------------------------------------------------------ the clients


@dataclass
class ClientReport:
    """One client process's view: successes and their latencies while counting, and
    every failure (warm-up included) by kind, with when it happened (time.monotonic,
    one clock for every process)."""

    latencies_s: list[float] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    error_times: list[float] = field(default_factory=list)


async def _loops(
    url: str, clients: int, timeout_s: float, counting: Event, stop: Event
) -> ClientReport:
    """``clients`` request loops until ``stop``."""
    import aiohttp

    report, flags = ClientReport(), {"counting": False, "stop": False}

    async def follow() -> None:  # the main process's events, read off the request path
        while not flags["stop"]:
            flags["counting"], flags["stop"] = counting.is_set(), stop.is_set()
            await asyncio.sleep(0.05)

    connector = aiohttp.TCPConnector(limit=clients)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(url, connector=connector, timeout=timeout) as http:

        async def one() -> None:
            while not flags["stop"]:
                started, kind = time.monotonic(), None
                try:
                    async with http.post("/v1/images/generations", json=BODY) as response:
                        await response.read()
                        if response.status != 200:
                            kind = f"http {response.status}"
                except (aiohttp.ClientError, TimeoutError) as exc:
                    kind = type(exc).__name__
                if kind is not None:
                    report.errors[kind] += 1
                    report.error_times.append(time.monotonic())
                elif flags["counting"] and not flags["stop"]:
                    report.latencies_s.append(time.monotonic() - started)

        await asyncio.gather(follow(), *(one() for _ in range(clients)))
    return report


def client_process(
    url: str, clients: int, timeout_s: float, counting: Event, stop: Event, out: Queue
) -> None:
    out.put(asyncio.run(_loops(url, clients, timeout_s, counting, stop)))


# ------------------------------------------------------------ the router side


def _warm_up(pid: int, url: str, fds: int, requests: int, timeout_s: float = 300) -> None:
    """Until the router holds ``fds`` descriptors (every client loop has its connection)
    and has taken ``requests`` requests: its allocator has seen the load."""
    deadline = time.monotonic() + timeout_s
    while open_fds(pid) < fds or scrape(url).accepted < requests:
        if time.monotonic() > deadline:
            raise RuntimeError(f"no warm load: {open_fds(pid)} of {fds} fds")
        time.sleep(0.5)


def sample(pid: int, url: str, t0: float) -> Sample:
    t_s, rss, fds = time.monotonic() - t0, rss_mb(pid), open_fds(pid)
    accepted = scrape(url).accepted
    return Sample(t_s, rss, fds, accepted, time.monotonic() - t0 - t_s)


def _cpu_s(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


def _runnable_wait_s(pid: int) -> float:
    """How long the process's main thread (the router's event loop) has waited for a CPU
    while it was ready to run: what a busy machine, not the router, costs it."""
    return int(Path(f"/proc/{pid}/schedstat").read_text().split()[1]) / 1e9


def watch(pid: int, url: str, args: argparse.Namespace) -> list[Sample]:
    """``args.samples`` + 1 samples over ``args.duration`` seconds, from now."""
    t0, samples = time.monotonic(), []
    for i in range(args.samples + 1):
        time.sleep(max(0.0, t0 + i * args.duration / args.samples - time.monotonic()))
        samples.append(sample(pid, url, t0))
        s = samples[-1]
        print(
            f"t={s.t_s:.0f}s rss_mb={s.rss_mb:.1f} fds={s.fds} accepted={s.accepted} "
            f"scrape_s={s.scrape_s:.2f}",
            flush=True,
        )
    return samples


def soak(args: argparse.Namespace, log_dir: Path) -> str:
    http_port = free_port()
    url = f"http://127.0.0.1:{http_port}"
    endpoints = [f"tcp://127.0.0.1:{free_port()}" for _ in range(args.drivers)]
    stub = [sys.executable, str(HERE / "stub_driver.py")]
    drivers = [
        subprocess.Popen([*stub, "--port", e.rsplit(":", 1)[1], "--replica", str(i)])
        for i, e in enumerate(endpoints)
    ]
    cmd = [sys.executable, "-m", "dpserve", "router", "--port", str(http_port)]
    cmd += ["--max-inflight-per-replica", str(args.max_inflight_per_replica)]
    cmd += ["--max-waiting", str(args.max_waiting), "--request-timeout", str(args.timeout)]
    cmd += connection_flags(args.clients)
    for endpoint in endpoints:
        cmd += ["--worker", endpoint]
    router_log = (log_dir / "router.log").open("wb")
    # The access log (stdout) would cost the bench's own output; warnings go to a file.
    router = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=router_log)
    procs = max(1, min(args.client_procs, args.clients))
    shares = [args.clients // procs + (i < args.clients % procs) for i in range(procs)]
    ctx = get_context("spawn")
    counting, stop, out = ctx.Event(), ctx.Event(), ctx.Queue()
    clients = [
        ctx.Process(
            target=client_process, args=(url, n, args.timeout, counting, stop, out), daemon=True
        )
        for n in shares
    ]
    try:
        wait_ready(url, proc=router)
        time.sleep(1.0)  # one more ping round: every driver serves
        fds_idle_before = open_fds(router.pid)
        for client in clients:
            client.start()
        time.sleep(args.warmup)
        _warm_up(router.pid, url, fds_idle_before + args.clients, 5 * args.clients)
        counting.set()
        ours = psutil.Process().children(recursive=True)  # router, drivers, clients
        router_cpu, router_wait = _cpu_s(router.pid), _runnable_wait_s(router.pid)
        counted_from = time.monotonic()
        wall, foreign, samples = timed_round(ours, lambda: watch(router.pid, url, args))
        router_cores = (_cpu_s(router.pid) - router_cpu) / wall
        router_starved = (_runnable_wait_s(router.pid) - router_wait) / wall
        stop.set()
        reports: list[ClientReport] = [out.get(timeout=args.timeout + 60) for _ in clients]
        for client in clients:
            client.join(timeout=30)
        time.sleep(1.0)  # the clients' connections are closed: the router closes its ends
        fds_idle_after = open_fds(router.pid)
        books = scrape(url)
        if router.poll() is not None:
            raise RuntimeError(f"router exited with {router.returncode}")
    finally:
        stop.set()
        for proc in (router, *drivers):
            proc.terminate()
        for proc in (router, *drivers):
            proc.wait(timeout=30)
        router_log.close()
    latencies = sorted(t for r in reports for t in r.latencies_s)
    ok, errors = len(latencies), sum((r.errors for r in reports), Counter[str]())
    error_times = sorted(t - counted_from for r in reports for t in r.error_times)
    first, last = samples[0], samples[-1]
    window = last.t_s - first.t_s
    accepted_rps = (last.accepted - first.accepted) / window if window > 0 else 0.0
    print(f"rss_mb max={max(s.rss_mb for s in samples):.1f} fds max={max(s.fds for s in samples)}")
    print(f"throughput: {ok / wall:.0f} ok/s (clients), {accepted_rps:.0f}/s accepted")
    print(
        f"cpu: the router used {router_cores:.2f} cores, other processes {foreign:.2f}; "
        f"its event loop waited for a CPU {router_starved:.0%} of the time"
    )
    if latencies:
        p50, p99 = latencies[len(latencies) // 2], latencies[int(len(latencies) * 0.99)]
        print(f"latency_s p50={p50:.2f} p99={p99:.2f} max={latencies[-1]:.2f}")
    if errors:
        print(f"errors by kind: {dict(errors)}")
        spans = f"first at t={error_times[0]:.0f}s, last at t={error_times[-1]:.0f}s"
        print(f"errors: {spans} (negative: during the warm-up)")
        tail = (log_dir / "router.log").read_text(errors="replace").splitlines()[-20:]
        print("router log tail:", *tail, sep="\n  ")
    if books.unanswered:
        print(f"unbalanced books: {books}")
    answered = sum(books.answered.values())
    outcomes = " ".join(f"{k}={v}" for k, v in sorted(books.answered.items()))
    print(f"router answered by outcome: {outcomes}")
    return (
        f"soak clients={args.clients} duration_s={args.duration:.0f} requests={ok} "
        f"errors={sum(errors.values())} rss_start_mb={first.rss_mb:.1f} "
        f"rss_end_mb={last.rss_mb:.1f} rss_ratio={last.rss_mb / first.rss_mb:.3f} "
        f"fds_start={first.fds} fds_end={last.fds} fds_idle_before={fds_idle_before} "
        f"fds_idle_after={fds_idle_after} accepted={books.accepted} answered={answered}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--duration", type=float, default=300.0, help="seconds measured")
    parser.add_argument("--warmup", type=float, default=10.0, help="seconds of load before")
    parser.add_argument("--samples", type=int, default=10, help="RSS/fd samples in between")
    parser.add_argument("--drivers", type=int, default=2, help="stub drivers behind the router")
    parser.add_argument("--client-procs", type=int, default=2, help="processes for the clients")
    parser.add_argument("--max-inflight-per-replica", type=int, default=4096)
    parser.add_argument("--max-waiting", type=int, default=8192)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    parser.add_argument("--log-dir", type=Path, default=None, help="keep router.log there")
    args = parser.parse_args()
    if args.log_dir is not None:
        args.log_dir.mkdir(parents=True, exist_ok=True)
        print(soak(args, args.log_dir))
        return
    with tempfile.TemporaryDirectory(prefix="dpserve-soak-") as log_dir:
        line = soak(args, Path(log_dir))
    print(line)


if __name__ == "__main__":
    main()
