"""What the router adds: latency through it vs straight to a driver, and a 1000-client load.

Backend: bench/stub_driver.py, a real ZMQ driver that answers instantly with a
fixed PNG. Part 1 alternates sequential requests through the router (HTTP) and
straight to the driver (ZMQ) and reports the added p50/p99. Part 2 holds 1000
concurrent HTTP clients on the router for --duration seconds. Last line:
``added_p50_ms=<x> added_p99_ms=<y> errors=<n> rps=<r>``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import wait_ready
from dpserve.client import ReplicaClient
from dpserve.local import free_port

BODY = {"prompt": "x", "size": "64x64", "num_inference_steps": 1, "seed": 1}


def _percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] if len(values) > 1 else values[0]


def latency(url: str, endpoint: str, n: int) -> tuple[list[float], list[float]]:
    routed, direct = [], []
    with httpx.Client(base_url=url, timeout=30) as http, ReplicaClient(endpoint) as zmq_client:
        for _ in range(50):  # warm both paths
            http.post("/v1/images/generations", json=BODY)
            zmq_client.generate(**BODY)
        for _ in range(n):
            start = time.perf_counter()
            http.post("/v1/images/generations", json=BODY).raise_for_status()
            routed.append(time.perf_counter() - start)
            start = time.perf_counter()
            zmq_client.generate(**BODY)
            direct.append(time.perf_counter() - start)
    return routed, direct


async def load(url: str, clients: int, duration_s: float) -> tuple[int, int]:
    """``clients`` concurrent request loops for ``duration_s``; returns (ok, errors).

    aiohttp, not httpx, on this side: httpx's pool costs grow with 1000
    connections until the load generator, not the router, is what is measured.
    """
    import aiohttp

    ok = errors = 0
    stop_at = time.monotonic() + duration_s
    connector = aiohttp.TCPConnector(limit=clients)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(url, connector=connector, timeout=timeout) as http:

        async def one_client() -> None:
            nonlocal ok, errors
            while time.monotonic() < stop_at:
                try:
                    async with http.post("/v1/images/generations", json=BODY) as response:
                        await response.read()
                        if response.status == 200:
                            ok += 1
                        else:
                            errors += 1
                except (aiohttp.ClientError, TimeoutError):
                    errors += 1

        await asyncio.gather(*(one_client() for _ in range(clients)))
    return ok, errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--duration", type=float, default=30.0)
    args = parser.parse_args()
    here = Path(__file__).resolve().parent
    zmq_port, http_port = free_port(), free_port()
    endpoint, url = f"tcp://127.0.0.1:{zmq_port}", f"http://127.0.0.1:{http_port}"
    stub = subprocess.Popen([sys.executable, str(here / "stub_driver.py"), "--port", str(zmq_port)])
    router = subprocess.Popen(
        [sys.executable, "-m", "dpserve", "router", "--worker", endpoint, "--port", str(http_port),
         "--max-inflight-per-replica", "4096", "--max-waiting", "8192", "--request-timeout", "60"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_ready(url)
        routed, direct = latency(url, endpoint, args.requests)
        started = time.perf_counter()
        ok, errors = asyncio.run(load(url, args.clients, args.duration))
        rps = ok / (time.perf_counter() - started)
    finally:
        router.terminate()
        stub.terminate()
        router.wait(timeout=30)
        stub.wait(timeout=30)
    p50 = (_percentile(routed, 50) - _percentile(direct, 50)) * 1000
    p99 = (_percentile(routed, 99) - _percentile(direct, 99)) * 1000
    for name, values in (("direct", direct), ("router", routed)):
        p50_ms, p99_ms = _percentile(values, 50) * 1000, _percentile(values, 99) * 1000
        print(f"{name} p50={p50_ms:.2f}ms p99={p99_ms:.2f}ms")
    print(f"load: {args.clients} clients x {args.duration:.0f}s: {ok} ok, {errors} errors")
    print(f"added_p50_ms={p50:.2f} added_p99_ms={p99:.2f} errors={errors} rps={rps:.0f}")


if __name__ == "__main__":
    main()
