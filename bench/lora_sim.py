"""bench/lora_mix.py's fleet simulated: what adapter-aware routing saves on the same mix.

Two replicas, each an LRU cache of ``--cache`` adapters, serve a Zipf mix of
``--adapters`` adapters arriving open loop at ``--util`` of their capacity. A request
takes ``c = 1`` and a miss adds ``--load`` (in requests), each exactly, or varying around
those means with ``--cv``. The router sees each replica's work ahead: the running
request's rest exactly, each queued one's run (its mean with ``--cv``) and, under the
aware policies, the load it counted when it sent it there (``--ledger``); each replica's
seconds per request are 1, or (``--calibration loads``) its measured mean with its
loads in, as the worker's calibration had them. As the real router, it gives a replica
at most ``--slots`` requests (a holder of the request's adapter, or its home, up to
HOLDER_CAP_FACTOR times that under the aware policies), and holds the rest in one FIFO.
Simulated, on the same arrivals:

- ``blind``: least work (idle replicas take turns);
- ``hashed``: the router's own adapter-aware least work (dpserve/router/policies.py:
  a missing adapter's load counted, twice into a full cache; holders within the tie),
  homes by a rendezvous hash alone;
- ``aware``: the same with homes placed by the demand it saw, as the router does
  (dpserve/router/adapter_homes.py);
- ``hot_split``: the hottest ``--cache`` adapters on one replica, the rest on the
  other, never balanced;
- ``bound``: no routing at all: each replica holds a fixed half of the adapters,
  balanced by demand, so no adapter is in both caches. Not a true bound: a split
  unbalanced on purpose (one cache for the hottest only) makes fewer loads still.

Last line: ``bound_loads_ratio=<blind/bound> hashed_loads_ratio=<blind/hashed>
hashed_p99_ratio=<blind/hashed> sim_loads_ratio=<blind/aware>
sim_p99_ratio=<blind/aware> sim_p90_ratio=<blind/aware> sim_p50_ratio=<blind/aware>
hot_split_loads_ratio=<blind/hot_split> hot_split_p99_ratio=<blind/hot_split>``
(with ``--trials K``, each the median over K arrival streams).
"""

from __future__ import annotations

import argparse
import random
import sys
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dpserve.router.adapter_homes import AdapterHomes
from dpserve.router.adapters import HOLDER_CAP_FACTOR, miss_seconds
from dpserve.router.policies import HOME_SLACK, Estimate, LeastWork

CALIBRATION_ALPHA = 0.2  # dpserve.contract.cost.Calibration's


class Job(NamedTuple):
    at: float  # arrival
    adapter: int
    work: float  # its run, in requests: 1 on average
    load: float  # its adapter's load, were it missing, as a multiple of --load


@dataclass
class Server:
    capacity: int
    cache: OrderedDict[int, None] = field(default_factory=OrderedDict)
    queue: list[Job] = field(default_factory=list)
    free_at: float = 0.0
    # The router's seconds per request here: 1 (its run, known exactly), or with
    # --calibration loads a replica's own measure of its requests' times, loads
    # included, as dpserve.contract.cost's Calibration (an EWMA in log space) keeps it.
    per_request: float = 1.0
    learn: float = 0.0  # that EWMA's alpha; 0: exact
    # Each queued request's adapter load as the router counted it when it sent it
    # there (--ledger router); --ledger runs leaves queued loads out.
    loads_ahead: list[float] = field(default_factory=list)

    def enqueue(self, job: Job, load: float) -> None:
        self.queue.append(job)
        self.loads_ahead.append(load)

    def present(self) -> set[int]:
        return set(self.cache) | {j.adapter for j in self.queue}

    def full(self) -> bool:
        return len(self.cache) >= self.capacity

    def in_flight(self, now: float) -> int:
        return len(self.queue) + (self.free_at > now)

    def work(self, now: float) -> float:
        """The router's view of the work ahead here, in requests."""
        ahead = self.per_request * len(self.queue) + sum(self.loads_ahead)
        return max(0.0, self.free_at - now) + ahead

    def start(self, c: float, load: float, done: list[float]) -> bool:
        """Runs its next request; True when that one loaded its adapter."""
        job = self.queue.pop(0)
        self.loads_ahead.pop(0)
        begin = max(self.free_at, job.at)
        miss = job.adapter not in self.cache
        self.cache[job.adapter] = None
        self.cache.move_to_end(job.adapter)
        if len(self.cache) > self.capacity:
            self.cache.popitem(last=False)
        took = c * job.work + (load * job.load if miss else 0.0)
        self.free_at = begin + took
        done.append(self.free_at - job.at)
        if self.learn:
            self.per_request *= (took / self.per_request) ** self.learn
        return miss


def zipf(count: int, s: float) -> list[float]:
    return [1.0 / (k + 1) ** s for k in range(count)]


def arrivals(
    n: int, rate: float, weights: Sequence[float], seed: int, cv: float = 0.0
) -> list[Job]:
    """Poisson arrivals of a Zipf mix; each request's run and load vary by gamma draws
    of mean 1 and coefficient of variation ``cv`` (0: every one the same)."""
    rng, at, out = random.Random(seed), 0.0, []

    def draw() -> float:
        return rng.gammavariate(1 / cv**2, cv**2) if cv > 0 else 1.0

    for _ in range(n):
        at += rng.expovariate(rate)
        adapter = rng.choices(range(len(weights)), weights=weights)[0]
        out.append(Job(at, adapter, draw(), draw()))
    return out


class Blind:
    """Least work blind to adapters: idle replicas take turns."""

    def __init__(self) -> None:
        self._turns = iter(range(1 << 62))

    def home(self, adapter: int) -> int | None:
        return None

    def pick(self, servers: list[Server], ok: list[int], adapter: int, now: float) -> int:
        least = min(servers[i].work(now) for i in ok)
        tied = [i for i in ok if servers[i].work(now) <= least + 1e-9]
        return tied[next(self._turns) % len(tied)]


class Aware:
    """The router's own adapter-aware least work (dpserve/router/policies.py) over the
    simulated replicas' estimates, with homes placed by the demand it saw
    (adapter_homes.py) or, ``placed=False``, the rendezvous hash alone."""

    def __init__(self, load: float, placed: bool, home_slack: float = HOME_SLACK) -> None:
        self.load, self.placed = load, placed
        self.policy = LeastWork(home_frac=home_slack)
        self.homes = AdapterHomes()
        self._home: int | None = None
        self._slots: dict[str, int] = {}

    def seen(self, adapter: int, servers: list[Server]) -> None:
        self.homes.demand.seen(str(adapter))
        self._slots = {str(i): s.capacity for i, s in enumerate(servers)}

    def home(self, adapter: int) -> int | None:
        if not self.placed:
            return None
        found = self.homes.home(str(adapter), self._slots)
        return None if found is None else int(found)

    def pick(self, servers: list[Server], ok: list[int], adapter: int, now: float) -> int:
        def estimate(key: str) -> Estimate:
            s = servers[int(key)]
            lacks = adapter not in s.present()
            return Estimate(
                s.work(now),
                s.per_request,
                miss_seconds(self.load, lacks and s.full()) if lacks else 0.0,
            )

        home = self.home(adapter)
        keys = [str(i) for i in ok]
        got = self.policy.pick(
            keys, lambda k: True, estimate, str(adapter), None if home is None else str(home)
        )
        assert got is not None
        return int(got)


class HotSplit:
    """No balancing: the ``cache`` hottest adapters always go to replica 0, the rest to
    replica 1, however long the queue (run without a cap): the loads a split by demand
    saves when nothing spills, and the p99 it costs."""

    def __init__(self, cache: int) -> None:
        self.cache = cache

    def home(self, adapter: int) -> int | None:
        return 0 if adapter < self.cache else 1  # adapters are numbered hottest first

    def pick(self, servers: list[Server], ok: list[int], adapter: int, now: float) -> int:
        return 0 if adapter < self.cache else 1


Policy = Blind | Aware | HotSplit


def simulate(
    stream: list[Job], policy: Policy, slots: int, args: argparse.Namespace
) -> tuple[float, float, float, float]:
    """Loads per request, p50, p90 and p99 latency (in requests)."""
    alpha = CALIBRATION_ALPHA if args.calibration == "loads" else 0.0
    servers = [Server(args.cache, learn=alpha) for _ in range(2)]
    waiting: list[Job] = []
    done: list[float] = []
    loads = 0
    counted = args.ledger == "router" and isinstance(policy, Aware)

    def send(i: int, job: Job) -> None:
        s = servers[i]
        lacks = counted and job.adapter not in s.present()
        s.enqueue(job, args.load if lacks else 0.0)

    def advance(now: float) -> None:
        nonlocal loads
        progressed = True
        while progressed:
            progressed = False
            for s in servers:
                if s.queue and max(s.free_at, s.queue[0][0]) <= now:
                    loads += s.start(1.0, args.load, done)
                    progressed = True
            while waiting:  # the FIFO takes slots as they free, in order
                at, adapter = waiting[0].at, waiting[0].adapter
                t = max(at, min(s.free_at for s in servers))
                if t > now:
                    break
                ok = [i for i, s in enumerate(servers) if s.in_flight(t) < slots]
                if not ok:
                    break
                job = waiting.pop(0)
                send(policy.pick(servers, ok, adapter, t), job)
                progressed = True

    for job in stream:
        at, adapter = job.at, job.adapter
        advance(at)
        if isinstance(policy, Aware):
            policy.seen(adapter, servers)
        ok = [i for i, s in enumerate(servers) if s.in_flight(at) < slots] if not waiting else []
        if isinstance(policy, Aware) and not waiting:  # admission.py's stretch
            home = policy.home(adapter)
            ok += [
                i
                for i, s in enumerate(servers)
                if i not in ok
                and (adapter in s.present() or i == home)
                and s.in_flight(at) < HOLDER_CAP_FACTOR * slots
            ]
        if ok:
            send(policy.pick(servers, ok, adapter, at), job)
        else:
            waiting.append(job)
    advance(float("inf"))
    done.sort()
    p90, p99 = (done[int(q * (len(done) - 1))] for q in (0.9, 0.99))
    return loads / len(stream), done[len(done) // 2], p90, p99


def bound_loads(stream: list[Job], weights: Sequence[float], cache: int) -> float:
    """Loads per request with each adapter fixed to one replica (demand balanced)."""
    halves: list[set[int]] = [set(), set()]
    demand = [0.0, 0.0]
    for k, w in enumerate(weights):
        side = demand.index(min(demand))
        halves[side].add(k)
        demand[side] += w
    loads = 0
    for half in halves:
        lru: OrderedDict[int, None] = OrderedDict()
        for a in (j.adapter for j in stream):
            if a not in half:
                continue
            loads += a not in lru
            lru[a] = None
            lru.move_to_end(a)
            if len(lru) > cache:
                lru.popitem(last=False)
    return loads / len(stream)


def figures(args: argparse.Namespace, seed: int, show: bool) -> dict[str, float]:
    """One arrival stream under every policy: the last line's ratios."""
    weights = zipf(args.adapters, args.zipf)
    stream = arrivals(args.requests, args.util * 2, weights, seed, args.cv)
    b = simulate(stream, Blind(), args.slots, args)
    h = simulate(stream, Aware(args.load, placed=False), args.slots, args)
    a = simulate(
        stream, Aware(args.load, placed=True, home_slack=args.home_slack), args.slots, args
    )
    hot = simulate(stream, HotSplit(args.cache), 1 << 30, args)
    bound = bound_loads(stream, weights, args.cache)
    if show:
        named = (("blind", b), ("hashed", h), ("aware", a), ("hot_split", hot))
        for name, (loads, p50, p90, p99) in named:
            print(
                f"{name}: loads_per_100={100 * loads:.1f} p50={p50:.2f} p90={p90:.2f} p99={p99:.2f}"
            )
        print(f"bound: loads_per_100={100 * bound:.1f}")
    return {
        "bound_loads_ratio": b[0] / bound,
        "hashed_loads_ratio": b[0] / h[0],
        "hashed_p99_ratio": b[3] / h[3],
        "sim_loads_ratio": b[0] / a[0],
        "sim_p99_ratio": b[3] / a[3],
        "sim_p90_ratio": b[2] / a[2],
        "sim_p50_ratio": b[1] / a[1],
        "hot_split_loads_ratio": b[0] / hot[0],
        "hot_split_p99_ratio": b[3] / hot[3],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--adapters", type=int, default=16)
    parser.add_argument("--cache", type=int, default=4)
    parser.add_argument("--zipf", type=float, default=1.1)
    parser.add_argument("--util", type=float, default=0.7)
    parser.add_argument("--load", type=float, default=0.5, help="a load, in requests")
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument(
        "--cv",
        type=float,
        default=0.0,
        help="each request's run and load vary with this coefficient of variation (the "
        "router estimates their means); 0: all alike",
    )
    parser.add_argument(
        "--ledger",
        choices=("router", "runs"),
        default="router",
        help="router: a replica's work ahead holds each queued request's adapter load as "
        "the aware router counted it at sending (once); runs: queued requests' runs only",
    )
    parser.add_argument(
        "--calibration",
        choices=("exact", "loads"),
        default="exact",
        help="exact: the router knows a request's run; loads: each replica's measured "
        "seconds per request include its adapter loads (the worker's calibration before "
        "it left them out)",
    )
    parser.add_argument(
        "--home-slack", type=float, default=HOME_SLACK, help="aware's --adapter-home-slack"
    )
    parser.add_argument("--requests", type=int, default=40000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--trials",
        type=int,
        default=1,
        help="streams (seeds from --seed on): the figures are their medians, and the "
        "spread of one run's figures (lora_mix.py's sampling noise at its --requests) "
        "is printed before them",
    )
    args = parser.parse_args()
    runs = [figures(args, args.seed + t, show=args.trials == 1) for t in range(args.trials)]
    if args.trials > 1:
        for name in runs[0]:
            got = sorted(r[name] for r in runs)
            low, high = (got[round(q * (len(got) - 1))] for q in (0.1, 0.9))
            print(f"{name}: p10={low:.2f} p90={high:.2f} min={got[0]:.2f} max={got[-1]:.2f}")
    print(" ".join(f"{name}={median(r[name] for r in runs):.2f}" for name in runs[0]))


if __name__ == "__main__":
    main()
