"""Per-request LoRA across a dp=2 fleet: adapter-aware routing against adapter-blind, one run.

Three `dpserve serve --dp-size 2` services of the small tiny model, each replica with an
adapter cache that holds 4 of the 16 tiny adapters, differ only in routing: least-work
that knows where adapters are resident (the default), least-work blind to them, and
round-robin. Each gets the same requests: adapters drawn with a Zipf mix (s = 1.1), sent
**open loop** (seeded Poisson arrivals at ``--load`` of the fleet's capacity without
adapters, measured as its throughput with two clients in a closed loop, a request at a
time on each replica; and again at ``--light`` load for aware and blind), so the
router has a choice to make: a closed loop with as many clients as the fleet
has slots leaves every request exactly one free slot. Loads come on top of the load
given. Measured per service: the cache's hit rate and loads per 100 requests (from the
router's /metrics, the replicas' own counts), p50, p90 and p99 latency from arrival.
The services run one at a time (the others idle) so they do not share the 2 cores.

The adapters are rank 64 (10 MiB) and requests take one step: on this CPU a load then
costs about half a request (0.45-0.57 measured), as a real diffusion LoRA's load
(hundreds of MB, peft wrapping every layer: a second or more) does on a GPU next to a
few-step generation; ``load_over_request`` prints the ratio measured.

Then, on the first service: a request's time with its adapter applied per request (the
adapter resident) against the same adapter merged into the weights (``set_lora`` and
``merge_lora_weights``) and no per-request adapter, requests alternating.

``--home-slack S`` (repeatable) adds an aware service at ``--adapter-home-slack S`` (the
default is 1.5): how much of the detour to the adapters' home buys loads with latency.

Last line: ``hit_rate=<aware> loads_per_100=<aware> blind_loads_ratio=<blind/aware>
blind_p99_ratio=<blind/aware> blind_p90_ratio=<blind/aware> rr_p99_ratio=<rr/aware>
light_hit_rate=<aware, light> light_blind_loads_ratio=<blind/aware, light>
[slackS_blind_loads_ratio=<blind/it> slackS_blind_p90_ratio=<blind/it> ...]
per_request_vs_merged=<x>``.
"""

from __future__ import annotations

import argparse
import random
import re
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import cached_model
from dpserve.plumbing.ports import free_port

ADAPTERS = 16
RANK = 64
CACHED = 4  # adapters a replica's cache holds (its --lora-cache-mb is sized to 4, not 5)
ZIPF_S = 1.1
COUNTERS = ("hits", "misses", "loads", "evictions")


def adapters(model: Path, count: int, rank: int) -> list[Path]:
    from dpserve.worker.tiny_model import build_tiny_lora

    paths = []
    for seed in range(count):
        path = model.parent / f"{model.name}-lora-r{rank}-seed{seed}"
        if not path.is_dir():
            build_tiny_lora(path, model, seed=seed, rank=rank)
        paths.append(path)
    return paths


def cache_mb(path: Path) -> int:
    """A cache that holds ``CACHED`` adapters of this size, not one more."""
    size = sum(f.stat().st_size for f in path.rglob("*.safetensors")) / 2**20
    return int(size * (CACHED + 0.5))


def zipf_sequence(count: int, n: int, seed: int) -> list[int]:
    weights = [1.0 / (k + 1) ** ZIPF_S for k in range(count)]
    return random.Random(seed).choices(range(count), weights=weights, k=n)


def arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Seconds from the start at which each request arrives: a Poisson process."""
    rng, at, out = random.Random(seed), 0.0, []
    for _ in range(n):
        at += rng.expovariate(rate)
        out.append(at)
    return out


class Serve:
    def __init__(self, model: Path, flags: list[str]) -> None:
        self.url = f"http://127.0.0.1:{free_port()}"
        port = self.url.rsplit(":", 1)[1]
        cmd = [sys.executable, "-m", "dpserve", "serve", "--model", str(model), "--port", port]
        cmd += ["--dp-size", "2", "--scheduler-port", str(free_port()), *flags]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.http = httpx.Client(base_url=self.url, timeout=600)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if self.http.get("/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"serve {flags} did not come up")

    def generate(self, body: dict[str, object]) -> float:
        start = time.perf_counter()
        response = self.http.post("/v1/images/generations", json=body)
        response.raise_for_status()
        return time.perf_counter() - start

    def counters(self) -> dict[str, float]:
        """The fleet's adapter-cache counts, summed over replicas from /metrics."""
        text = self.http.get("/metrics").text
        out = dict.fromkeys(COUNTERS, 0.0)
        for name in COUNTERS:
            pattern = rf"^dpserve_lora_cache_{name}_total\{{[^}}]*\}} ([0-9.e+]+)$"
            out[name] = sum(float(v) for v in re.findall(pattern, text, re.M))
        return out

    def load_s(self) -> float:
        """The replicas' measured seconds per adapter load (their mean)."""
        replicas = self.http.get("/health/replicas").json()["replicas"]
        got = [r["adapters"]["load_s"] for r in replicas if (r.get("adapters") or {}).get("load_s")]
        return statistics.mean(got) if got else float("nan")

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=120)


def body(args: argparse.Namespace, paths: list[Path], index: int | None, seed: int) -> dict:
    out: dict[str, object] = {
        "prompt": "a lighthouse in a storm",
        "size": f"{args.size}x{args.size}",
        "num_inference_steps": args.steps,
        "seed": seed,
    }
    if index is not None:
        out["lora"] = {"name": f"style-{index}", "path": str(paths[index]), "scale": 1.0}
    return out


def run_mix(
    serve: Serve, args: argparse.Namespace, paths: list[Path], mix: list[int], at: list[float]
) -> dict:
    before = serve.counters()
    start = time.perf_counter()

    def one(i: int) -> float:
        time.sleep(max(0.0, start + at[i] - time.perf_counter()))  # its arrival
        serve.generate(body(args, paths, mix[i], i))
        return time.perf_counter() - (start + at[i])  # from arrival: router queue included

    with ThreadPoolExecutor(64) as pool:
        times = list(pool.map(one, range(len(mix))))
    after = serve.counters()
    got = {k: after[k] - before[k] for k in COUNTERS}
    lookups = got["hits"] + got["misses"]
    times.sort()
    return {
        "hit_rate": got["hits"] / lookups if lookups else 0.0,
        "loads_per_100": 100.0 * got["loads"] / len(mix),
        "p50": statistics.median(times),
        "p90": quantile(times, 0.90),
        "p99": quantile(times, 0.99),
        "load_s": serve.load_s(),
        **got,
    }


def quantile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def capacity_of(
    serve: Serve, args: argparse.Namespace, paths: list[Path]
) -> tuple[float, float, float]:
    """One plain request's seconds alone (a median); the fleet's requests per second
    with two clients in a closed loop, one request at a time on each replica: the
    capacity the load is a fraction of; and with four, the router's cap of two per
    replica, one queued behind each running one. Two clients leave a replica idle while
    its answer travels and the next request comes (HTTP, the router, ZMQ, the PNG);
    four show how much more the gangs do when they never wait (printed, not used, so
    that runs stay comparable with the earlier ones)."""
    plain = body(args, paths, None, 0)
    alone = statistics.median(serve.generate(plain) for _ in range(args.capacity_rounds))

    def throughput(clients: int) -> float:
        count = clients * args.capacity_rounds
        with ThreadPoolExecutor(clients) as pool:
            start = time.perf_counter()
            list(pool.map(lambda _: serve.generate(plain), range(count)))
            return count / (time.perf_counter() - start)

    return alone, throughput(2), throughput(4)


def per_request_vs_merged(serve: Serve, args: argparse.Namespace, path: Path) -> float:
    """Median time with the adapter per request (resident) over with it merged."""
    per_request = body(args, [path], 0, 1)
    for _ in range(2):
        serve.generate(per_request)  # resident on both replicas
    own = [serve.generate(per_request) for _ in range(args.rounds)]
    lora = {"lora_nickname": "merged", "lora_path": str(path)}
    serve.http.post("/v1/set_lora", json=lora).raise_for_status()
    serve.http.post("/v1/merge_lora_weights", json={}).raise_for_status()
    plain = body(args, [path], None, 1)
    merged = [serve.generate(plain) for _ in range(args.rounds)]
    return statistics.median(own) / statistics.median(merged)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=1)
    # 1,600: over 400, one run's p99 ratio spans 0.99-1.72x from sampling alone
    # (bench/lora_sim.py --trials); the light runs, at under a quarter of the rate, keep 400.
    parser.add_argument("--requests", type=int, default=1600)
    parser.add_argument("--load", type=float, default=0.7, help="of capacity without adapters")
    parser.add_argument("--light", type=float, default=0.15, help="the light load's fraction")
    parser.add_argument(
        "--light-requests", type=int, default=400, help="requests at the light load"
    )
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--capacity-rounds", type=int, default=30, help="to measure capacity")
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--rank", type=int, default=RANK, help="the adapters' LoRA rank")
    parser.add_argument(
        "--home-slack",
        type=float,
        action="append",
        default=[],
        help="also an aware service at this --adapter-home-slack (repeatable): its loads "
        "and p90 against blind's, on the same arrivals",
    )
    args = parser.parse_args()
    model = cached_model("small")
    paths = adapters(model, ADAPTERS, rank=args.rank)
    base = ["--threads-per-rank", "1", "--max-sequence-length", "77"]
    base += ["--lora-cache-mb", str(cache_mb(paths[0])), "--allow-path", str(model.parent)]
    aware = ["--policy", "least_work", "--adapter-routing", "aware"]
    blind = ["--policy", "least_work", "--adapter-routing", "blind"]
    light = args.light_requests
    runs = {  # name: (flags, load, requests)
        "aware": (aware, args.load, args.requests),
        "blind": (blind, args.load, args.requests),
        **{
            f"slack{slack:g}": (
                [*aware, "--adapter-home-slack", str(slack)],
                args.load,
                args.requests,
            )
            for slack in args.home_slack
        },
        "rr": (["--policy", "round_robin"], args.load, args.requests),
        "aware_light": (aware, args.light, light),
        "blind_light": (blind, args.light, light),
    }
    results: dict[str, dict] = {}
    plain_s = capacity = saturated = 0.0
    for name, (flags, load, count) in runs.items():
        mix = zipf_sequence(ADAPTERS, count, args.seed)
        serve = Serve(model, base + flags)
        try:
            for _ in range(2):  # warm both replicas' paths
                serve.generate(body(args, paths, None, 0))
                serve.generate(body(args, paths, None, 0))
            if not plain_s:  # the capacity, measured once: the same arrivals for every service
                plain_s, capacity, saturated = capacity_of(serve, args, paths)
            at = arrivals(count, load * capacity, args.seed)
            results[name] = run_mix(serve, args, paths, mix, at)
            if name == "aware":
                results[name]["merged"] = per_request_vs_merged(serve, args, paths[0])
        finally:
            serve.close()
        shown = " ".join(f"{k}={v:.3f}" for k, v in results[name].items())
        print(f"{name}: {shown}", file=sys.stderr)
    r = results
    print(
        f"model=small size={args.size} steps={args.steps} requests={args.requests} open loop "
        f"at load={args.load} ({args.load * capacity:.2f} req/s) and light={args.light} "
        f"({light} requests) "
        f"adapters={ADAPTERS} rank={args.rank} cache={CACHED} per replica zipf_s={ZIPF_S} "
        f"request_s={plain_s:.3f} capacity_over_two_alone={capacity * plain_s / 2:.2f} "
        f"four_clients_over_capacity={saturated / capacity:.2f} "
        f"load_over_request={r['aware']['load_s'] / plain_s:.2f}"
    )
    for name, got in r.items():
        print(
            f"{name}: hit_rate={got['hit_rate']:.2f} loads_per_100={got['loads_per_100']:.1f} "
            f"evictions={got['evictions']:.0f} p50={got['p50']:.3f}s p90={got['p90']:.3f}s "
            f"p99={got['p99']:.3f}s"
        )
    slacks = "".join(
        f"{k}_blind_loads_ratio={r['blind']['loads'] / max(r[k]['loads'], 1):.2f} "
        f"{k}_blind_p90_ratio={r['blind']['p90'] / r[k]['p90']:.2f} "
        for k in (f"slack{s:g}" for s in args.home_slack)
    )
    print(
        f"hit_rate={r['aware']['hit_rate']:.2f} loads_per_100={r['aware']['loads_per_100']:.1f} "
        f"blind_loads_ratio={r['blind']['loads'] / max(r['aware']['loads'], 1):.2f} "
        f"blind_p99_ratio={r['blind']['p99'] / r['aware']['p99']:.2f} "
        f"blind_p90_ratio={r['blind']['p90'] / r['aware']['p90']:.2f} "
        f"rr_p99_ratio={r['rr']['p99'] / r['aware']['p99']:.2f} "
        f"light_hit_rate={r['aware_light']['hit_rate']:.2f} "
        f"light_blind_loads_ratio="
        f"{r['blind_light']['loads'] / max(r['aware_light']['loads'], 1):.2f} "
        f"{slacks}per_request_vs_merged={r['aware']['merged']:.2f}"
    )


if __name__ == "__main__":
    main()
