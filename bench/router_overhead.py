"""What the router adds: latency through it vs straight to a driver, and a 1000-client load.

Backend: bench/stub_driver.py, a real ZMQ driver that answers instantly with a
fixed PNG. Part 1 alternates sequential requests through the router (HTTP) and
straight to the driver (ZMQ) and reports the added p50/p99. Part 2 holds 1000
concurrent HTTP clients on the router for --duration seconds.

Four modes side by side, each its own stub and router: "open" (plaintext wire,
no API keys), "curve" (a CURVE wire key on the driver, the router and the direct
client), "locked" (CURVE and an API key on every HTTP request: one tenant) and
"tenants" (CURVE and a key file of four keys grouped into two tenants, the clients
taking the keys in turn: each request matched among four keys and counted for its
tenant, docs/tenants.md). Part 1 interleaves the modes request by request, so each
sees the same machine; the direct path gets the same wire as its router, so "added"
is the router's own cost in that mode. Part 2 loads one mode at a time, the modes
taking turns. The line before last:
``open: added_p50_ms=<x> added_p99_ms=<y> errors=<n> rps=<r> | curve: ... | tenants: ...``;
the last, tenants against one key (on/off, per request through the router):
``tenants/locked: routed_p50_ratio=<a> routed_p99_ratio=<b> rps_ratio=<c>``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import connection_flags, wait_ready
from dpserve.client import ReplicaClient
from dpserve.plumbing.curve import WireKey
from dpserve.plumbing.ports import free_port

BODY = {"prompt": "x", "size": "64x64", "num_inference_steps": 1, "seed": 1}


def _percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] if len(values) > 1 else values[0]


@dataclass
class Stack:
    """One mode's stub driver and router, and how a client reaches them."""

    name: str
    url: str
    endpoint: str
    key: WireKey | None
    headers: list[dict[str, str]]  # request i sends headers[i % len]
    procs: tuple[subprocess.Popen[bytes], ...]
    routed: list[float] = field(default_factory=list)
    direct: list[float] = field(default_factory=list)
    ok: int = 0
    errors: int = 0
    loaded_s: float = 0.0

    def stop(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            proc.wait(timeout=30)


def latency(stacks: list[Stack], n: int) -> None:
    """Sequential requests through each router and straight to each driver, the modes
    interleaved request by request, so each sees the same machine."""
    with contextlib.ExitStack() as hold:
        pairs = [
            (
                hold.enter_context(httpx.Client(base_url=s.url, timeout=30)),
                hold.enter_context(ReplicaClient(s.endpoint, key=s.key)),
            )
            for s in stacks
        ]
        for i in range(50 + n):  # the first 50 warm every path
            for stack, (http, zmq_client) in zip(stacks, pairs, strict=True):
                headers = stack.headers[i % len(stack.headers)]
                start = time.perf_counter()
                http.post("/v1/images/generations", json=BODY, headers=headers).raise_for_status()
                routed = time.perf_counter() - start
                start = time.perf_counter()
                zmq_client.generate(**BODY)
                if i >= 50:
                    stack.routed.append(routed)
                    stack.direct.append(time.perf_counter() - start)


async def load(
    url: str, clients: int, duration_s: float, headers: list[dict[str, str]]
) -> tuple[int, int]:
    """``clients`` concurrent request loops for ``duration_s``; returns (ok, errors).
    Client i sends ``headers[i % len]``.

    aiohttp, not httpx, on this side: httpx's pool costs grow with 1000
    connections until the load generator, not the router, is what is measured.
    """
    import aiohttp

    ok = errors = 0
    stop_at = time.monotonic() + duration_s
    connector = aiohttp.TCPConnector(limit=clients)
    timeout = aiohttp.ClientTimeout(total=60)
    session = aiohttp.ClientSession(url, connector=connector, timeout=timeout)
    async with session as http:

        async def one_client(sent: dict[str, str]) -> None:
            nonlocal ok, errors
            while time.monotonic() < stop_at:
                try:
                    post = http.post("/v1/images/generations", json=BODY, headers=sent)
                    async with post as response:
                        await response.read()
                        if response.status == 200:
                            ok += 1
                        else:
                            errors += 1
                except (aiohttp.ClientError, TimeoutError):
                    errors += 1

        await asyncio.gather(*(one_client(headers[i % len(headers)]) for i in range(clients)))
    return ok, errors


@dataclass(frozen=True)
class Figures:
    added_p50_ms: float
    added_p99_ms: float
    errors: int
    rps: float
    routed_p50_ms: float
    routed_p99_ms: float

    def line(self) -> str:
        return (
            f"added_p50_ms={self.added_p50_ms:.2f} added_p99_ms={self.added_p99_ms:.2f} "
            f"errors={self.errors} rps={self.rps:.0f}"
        )


API_KEY = "bench-api-key-0123456789abcdef"
# A key file's lines: four keys, two tenants.
TENANT_KEYS = tuple(
    (tenant, f"bench-{tenant}-key-{i}-0123456789")
    for tenant in ("team-a", "team-b")
    for i in (1, 2)
)
# name: (CURVE wire, API keys: none, one, or the tenants' file)
MODES = {
    "open": (False, "none"),
    "curve": (True, "none"),
    "locked": (True, "one"),
    "tenants": (True, "tenants"),
}


def start(name: str, args: argparse.Namespace, scratch: Path) -> Stack:
    here = Path(__file__).resolve().parent
    curve, keys = MODES[name]
    zmq_port, http_port = free_port(), free_port()
    endpoint, url = f"tcp://127.0.0.1:{zmq_port}", f"http://127.0.0.1:{http_port}"
    key = WireKey.generate() if curve else None
    wire: list[str] = []
    if key is not None:
        key.write(scratch / f"{name}.key")
        wire = ["--wire-key-file", str(scratch / f"{name}.key")]
    auth: list[str] = []
    headers: list[dict[str, str]] = [{}]
    if keys == "one":
        auth, headers = ["--api-key", API_KEY], [{"Authorization": f"Bearer {API_KEY}"}]
    elif keys == "tenants":
        key_file = scratch / "tenants.keys"
        key_file.write_text("".join(f"{tenant} {key}\n" for tenant, key in TENANT_KEYS))
        auth = ["--api-key-file", str(key_file)]
        headers = [{"Authorization": f"Bearer {key}"} for _, key in TENANT_KEYS]
    stub = subprocess.Popen(
        [sys.executable, str(here / "stub_driver.py"), "--port", str(zmq_port), *wire]
    )
    router = subprocess.Popen(
        [sys.executable, "-m", "dpserve", "router", "--worker", endpoint, "--port", str(http_port),
         "--max-inflight-per-replica", "4096", "--max-waiting", "8192", "--request-timeout", "60",
         *connection_flags(args.clients), *wire, *auth],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    stack = Stack(name, url, endpoint, key, headers, (router, stub))
    try:
        wait_ready(url, proc=router)
    except BaseException:
        stack.stop()
        raise
    return stack


def load_rounds(stacks: list[Stack], args: argparse.Namespace) -> None:
    """The load part: one mode at a time (the others idle), in ``--rounds`` turns, so
    a slower minute of a shared machine falls on every mode alike; the order turns
    too."""
    for turn in range(args.rounds):
        first = turn % len(stacks)  # each mode leads a turn in its turn: none always last
        for stack in stacks[first:] + stacks[:first]:
            started = time.perf_counter()
            turn_s = args.duration / args.rounds
            ok, errors = asyncio.run(load(stack.url, args.clients, turn_s, stack.headers))
            stack.loaded_s += time.perf_counter() - started
            stack.ok, stack.errors = stack.ok + ok, stack.errors + errors


def figures(stack: Stack, args: argparse.Namespace) -> Figures:
    for path, values in (("direct", stack.direct), ("router", stack.routed)):
        p50_ms, p99_ms = _percentile(values, 50) * 1000, _percentile(values, 99) * 1000
        print(f"{stack.name} {path} p50={p50_ms:.2f}ms p99={p99_ms:.2f}ms")
    shape = f"{args.clients} clients x {args.duration:.0f}s in {args.rounds} turns"
    print(f"{stack.name} load: {shape}: {stack.ok} ok, {stack.errors} errors")
    routed, direct = stack.routed, stack.direct
    return Figures(
        added_p50_ms=(_percentile(routed, 50) - _percentile(direct, 50)) * 1000,
        added_p99_ms=(_percentile(routed, 99) - _percentile(direct, 99)) * 1000,
        errors=stack.errors,
        rps=stack.ok / stack.loaded_s,
        routed_p50_ms=_percentile(routed, 50) * 1000,
        routed_p99_ms=_percentile(routed, 99) * 1000,
    )


def on_off(on: Figures, off: Figures) -> str:
    """Tenants on against off: latency through the router and throughput, as ratios."""
    return (
        f"tenants/locked: routed_p50_ratio={on.routed_p50_ms / off.routed_p50_ms:.3f} "
        f"routed_p99_ratio={on.routed_p99_ms / off.routed_p99_ms:.3f} "
        f"rps_ratio={on.rps / off.rps:.3f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--duration", type=float, default=30.0, help="load seconds per mode")
    parser.add_argument("--rounds", type=int, default=3, help="turns the load is split in")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="dpserve-bench-") as scratch:
        stacks: list[Stack] = []
        try:
            for name in MODES:
                stacks.append(start(name, args, Path(scratch)))
            latency(stacks, args.requests)
            load_rounds(stacks, args)
            results = {stack.name: figures(stack, args) for stack in stacks}
        finally:
            for stack in stacks:
                stack.stop()
    print(" | ".join(f"{name}: {f.line()}" for name, f in results.items()))
    print(on_off(results["tenants"], results["locked"]))


if __name__ == "__main__":
    main()
