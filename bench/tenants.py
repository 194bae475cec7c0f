"""Fair shares between tenants: a light tenant beside a flooder, past capacity.

Backend: stub replicas (tests/stub_replica.py, the real wire protocol) in a process of
their own, each answering every request after ``--service-s`` (+- ``--jitter`` of it,
uniform) and reporting ``--max-batch``, so the router holds ``2 x max-batch`` requests
on each: capacity is ``replicas x 2 x max-batch / service-s`` requests a second,
whatever the machine. The jitter matters: with one exact time, every slot taken at
once frees at once, a service time later, for ever; the light tenant then waits up
to a whole service time for the next burst under any order (seen: p50 1.3x, p99 1.6x
with 0.5 s exact; +- 10 % still bunched within a phase), which no real model does.
One ``dpserve router`` over them, from ``--code`` (default: this checkout; point it at
another checkout's tree to measure that code), with a key file of two tenants.

Three phases of open-loop Poisson arrivals, one run, the same light arrivals twice:
``alone``: the light tenant at ``--light-share`` of capacity; ``mixed``: the same
light arrivals and a heavy tenant sending ten times its rate (together past
capacity); ``single``: one tenant sending the mixed phase's whole rate. Latency is
from a request's send to its answer; the first ``--warmup-s`` of each phase is left
out. Figures: the light tenant's p50 and p99 mixed over alone (fair shares: near 1),
its 429 share, the heavy tenant's 429 share, and the mixed phase's completed requests
a second over the single tenant's (the same offered load; expected >= 0.95).
``--router-flag`` passes flags to the router (``--max-requests-per-tenant 64``).
Last line: ``light_p50_ratio=<> light_p99_ratio=<> light_429_share=<>
heavy_429_share=<> tput_ratio=<>``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import wait_ready
from dpserve.plumbing.ports import free_port

BODY = {"prompt": "x", "size": "64x64", "num_inference_steps": 1, "seed": 1}
KEYS = {"light": "bench-light-key-0123456789abcdef", "heavy": "bench-heavy-key-0123456789abcdef"}
HEAVY_TIMES = 10


async def _stubs(count: int, service_s: float, jitter: float, max_batch: int) -> None:
    """The replicas: print their endpoints, serve until stdin closes."""
    import zmq.asyncio

    from dpserve.contract import protocol as p
    from tests.stub_replica import StubReplica

    rng = random.Random(0)

    class Jittered(StubReplica):
        async def _generate(self, identity: bytes, message: p.Message) -> None:
            # Read by the stub before its first await: this request's own time.
            self.generate_s = service_s * rng.uniform(1 - jitter, 1 + jitter)
            await super()._generate(identity, message)

    ctx = zmq.asyncio.Context()
    stubs = [Jittered(ctx, replica=i, max_batch=max_batch) for i in range(count)]
    print(" ".join(s.endpoint for s in stubs), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    for stub in stubs:
        await stub.close()
    ctx.term()


@dataclass
class Tally:
    """One tenant's answers in one phase (those sent after the warm-up)."""

    latencies: list[float] = field(default_factory=list)
    refused: int = 0  # 429
    failed: int = 0  # anything else
    done_at: list[float] = field(default_factory=list)  # completion times, every request

    @property
    def sent(self) -> int:
        return len(self.latencies) + self.refused + self.failed

    def share_refused(self) -> float:
        return self.refused / self.sent if self.sent else 0.0

    def quantile(self, q: int) -> float:
        values = self.latencies
        if len(values) < 2:
            return values[0] if values else float("nan")
        return statistics.quantiles(values, n=100)[q - 1]


def arrivals(rate: float, duration_s: float, seed: int) -> list[float]:
    rng, at, out = random.Random(seed), 0.0, []
    while True:
        at += rng.expovariate(rate)
        if at >= duration_s:
            return out
        out.append(at)


async def phase(url: str, load: dict[str, list[float]], warmup_s: float) -> dict[str, Tally]:
    """Send each tenant's arrivals (seconds from the start) and tally the answers."""
    import aiohttp

    tallies = {tenant: Tally() for tenant in load}
    connector = aiohttp.TCPConnector(limit=2000)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(url, connector=connector, timeout=timeout) as http:
        start = time.monotonic()

        async def one(tenant: str, at: float) -> None:
            await asyncio.sleep(max(0.0, start + at - time.monotonic()))
            headers = {"Authorization": f"Bearer {KEYS[tenant]}"}
            sent = time.monotonic()
            try:
                async with http.post("/v1/images/generations", json=BODY, headers=headers) as r:
                    await r.read()
                    status = r.status
            except (aiohttp.ClientError, TimeoutError):
                status = 0
            now = time.monotonic()
            tally = tallies[tenant]
            if status == 200:
                tally.done_at.append(now - start)
            if at < warmup_s:
                return
            if status == 200:
                tally.latencies.append(now - sent)
            elif status == 429:
                tally.refused += 1
            else:
                tally.failed += 1

        await asyncio.gather(*(one(t, at) for t, times in load.items() for at in times))
    return tallies


def throughput(tallies: dict[str, Tally], warmup_s: float, duration_s: float) -> float:
    """Requests completed a second between the warm-up and the last arrival."""
    done = sum(warmup_s <= t < duration_s for tally in tallies.values() for t in tally.done_at)
    return done / (duration_s - warmup_s)


def report(name: str, tallies: dict[str, Tally]) -> None:
    for tenant, t in tallies.items():
        print(
            f"{name} {tenant}: sent={t.sent} ok={len(t.latencies)} 429={t.refused} "
            f"other={t.failed} p50={t.quantile(50):.3f}s p99={t.quantile(99):.3f}s",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--service-s", type=float, default=1.0)
    parser.add_argument("--jitter", type=float, default=0.5, help="service time +- this share")
    parser.add_argument("--light-share", type=float, default=0.2, help="of capacity")
    parser.add_argument("--duration", type=float, default=35.0, help="seconds a phase")
    parser.add_argument("--warmup-s", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--code", type=Path, help="the router's source tree (default: this)")
    parser.add_argument("--router-flag", action="append", default=[])
    parser.add_argument("--stubs", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.stubs:
        asyncio.run(_stubs(args.replicas, args.service_s, args.jitter, args.max_batch))
        return

    here = Path(__file__).resolve().parent
    code = (args.code or here.parent).resolve()
    capacity = args.replicas * 2 * args.max_batch / args.service_s
    light_rps = args.light_share * capacity
    heavy_rps = HEAVY_TIMES * light_rps
    print(
        f"capacity={capacity:.1f}/s light={light_rps:.1f}/s heavy={heavy_rps:.1f}/s "
        f"(offered {(light_rps + heavy_rps) / capacity:.2f}x capacity) router code: {code}",
        flush=True,
    )
    stubs = subprocess.Popen(
        [sys.executable, str(here / "tenants.py"), "--stubs", "--replicas", str(args.replicas),
         "--service-s", str(args.service_s), "--jitter", str(args.jitter),
         "--max-batch", str(args.max_batch)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
    )  # fmt: skip
    assert stubs.stdout is not None and stubs.stdin is not None
    endpoints = stubs.stdout.readline().decode().split()
    if not endpoints:
        raise SystemExit("the stub replicas did not start")
    with tempfile.TemporaryDirectory() as scratch:
        keys = Path(scratch) / "keys"
        keys.write_text("".join(f"{tenant} {key}\n" for tenant, key in KEYS.items()))
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        workers = [x for e in endpoints for x in ("--worker", e)]
        router = subprocess.Popen(
            [sys.executable, "-m", "dpserve", "router", *workers, "--port", str(port),
             "--api-key-file", str(keys), "--max-connections", "4000",
             "--max-connections-per-peer", "0", *args.router_flag],
            cwd=code, env={**os.environ, "PYTHONPATH": str(code)},
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            wait_ready(url, proc=router)
            time.sleep(1.0)  # a ping or two: the replicas' batch sizes are known
            run(url, args, light_rps, heavy_rps)
        finally:
            router.terminate()
            router.wait(timeout=30)
            stubs.stdin.close()
            stubs.wait(timeout=30)


def run(url: str, args: argparse.Namespace, light_rps: float, heavy_rps: float) -> None:
    d, w = args.duration, args.warmup_s
    light = arrivals(light_rps, d, args.seed)
    heavy = arrivals(heavy_rps, d, args.seed + 1)
    single = arrivals(light_rps + heavy_rps, d, args.seed + 2)
    alone = asyncio.run(phase(url, {"light": light}, w))
    report("alone", alone)
    mixed = asyncio.run(phase(url, {"light": light, "heavy": heavy}, w))
    report("mixed", mixed)
    one = asyncio.run(phase(url, {"heavy": single}, w))
    report("single", one)
    tput_mixed, tput_one = throughput(mixed, w, d), throughput(one, w, d)
    print(f"throughput: mixed={tput_mixed:.1f}/s single={tput_one:.1f}/s", flush=True)
    a, m = alone["light"], mixed["light"]
    print(
        f"light_p50_ratio={m.quantile(50) / a.quantile(50):.2f} "
        f"light_p99_ratio={m.quantile(99) / a.quantile(99):.2f} "
        f"light_429_share={m.share_refused():.3f} "
        f"heavy_429_share={mixed['heavy'].share_refused():.3f} "
        f"tput_ratio={tput_mixed / tput_one:.3f}"
    )


if __name__ == "__main__":
    main()
