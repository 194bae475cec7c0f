"""What routing can gain under a mixed load, by discrete-event simulation (no replicas).

Two replicas each run one request at a time from their own FIFO; the router holds at
most ``cap`` requests per replica (running + queued there) and the rest in its own
FIFO. Arrivals are Poisson at ``load`` of the pair's capacity; 80 % small requests
(``small_s``), 20 % large (``large_s``); service times are exact (the estimates are
perfect: an upper bound on what a cost model can do). A request reaches its replica
``gap`` after the router binds it (the reply and the next send, about the router's
added latency in README's bench/router_overhead.py figures), so a replica that is
given work only once idle pays that gap each time; one with work queued does not.

Policies (``cap`` an upper bound for all of them):
``rr``  round-robin over replicas with a free slot (the seed's);
``lw``  least outstanding work among those (dpserve's LeastWork);
``lw_wait``  least work, waiting for a full replica when it would finish there first,
the router queue served strictly in order (a central schedule);
``late_own``  least work with late binding: a replica takes the head request only while
its outstanding work (the running one's remainder plus what is queued) is below that
request's own estimate, else the request waits at the router (FIFO);
``late_mean``  the same with a fixed bound: ``mean_frac`` x the mean request's cost;
``late_idle``  pure late binding: only an idle replica takes the head request (any
bound below the small request's cost behaves the same);
``sjf_aged``  late binding, the cheapest waiter first unless the oldest has waited
``age`` seconds (then it goes first: nothing starves past that);
``sjf``  the same without the age bound (large requests may starve; a reference).
Latency counts from arrival; the first 10 % of requests are left out (warm-up).
Throughput is measured apart, saturated: every request waiting at time 0, the figure
is requests over makespan (the gap is its only loss). docs/router.md, Routing policies,
quotes this. Last line, at load 0.7, large/small 15, cap 2, relative to ``rr``:
``sim_p99_gain_lw=<> sim_p99_gain_late_own=<> sim_p99_gain_late_mean=<>
sim_p99_gain_late_idle=<> sim_p99_gain_sjf_aged=<> sim_tput_gain_late_idle=<>``.
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
import statistics
from collections import deque
from dataclasses import dataclass, field

CANDIDATES = ("rr", "lw", "lw_wait", "late_own", "late_mean", "late_idle", "sjf_aged", "sjf")
END, ARRIVE, TIMER, LAND = 0, 1, 2, 3  # event kinds, in the order ties resolve


@dataclass
class _Replica:
    queue: deque[int] = field(default_factory=deque)  # arrived at the replica, FIFO
    landing: float = 0.0  # work bound here and still on the wire
    held: int = 0  # running + queued + on the wire: what the cap counts
    running: int | None = None
    started: float = 0.0


@dataclass
class _Sim:
    policy: str
    cap: int
    gap: float
    age: float
    mean_bound: float  # late_mean's bound, seconds
    costs: list[float]
    arrive: list[float]
    replicas: list[_Replica] = field(default_factory=lambda: [_Replica(), _Replica()])
    waiting: list[int] = field(default_factory=list)
    events: list[tuple[float, int, int]] = field(default_factory=list)
    last: int = 1  # round-robin cursor

    def work(self, r: _Replica, now: float) -> float:
        running = 0.0
        if r.running is not None:
            running = max(0.0, self.costs[r.running] - (now - r.started))
        return running + sum(self.costs[i] for i in r.queue) + r.landing

    def bound(self, i: int) -> float:
        """A replica takes request ``i`` only while its work is below this."""
        if self.policy in ("rr", "lw", "lw_wait"):
            return math.inf
        if self.policy == "late_mean":
            return self.mean_bound
        return self.costs[i] if self.policy == "late_own" else 0.0

    def takes(self, k: int, i: int, now: float) -> bool:
        r = self.replicas[k]
        if r.held >= self.cap:
            return False
        bound = self.bound(i)
        return r.held == 0 if bound == 0.0 else self.work(r, now) < bound

    def next_index(self, now: float) -> int:
        """Which waiter the router serves next."""
        if self.policy == "sjf" or (
            self.policy == "sjf_aged" and now - self.arrive[self.waiting[0]] < self.age
        ):
            return min(range(len(self.waiting)), key=lambda j: (self.costs[self.waiting[j]], j))
        return 0

    def pick(self, i: int, now: float) -> int | None:
        free = [k for k in (0, 1) if self.takes(k, i, now)]
        if self.policy == "rr":
            for step in (1, 2):
                k = (self.last + step) % 2
                if k in free:
                    self.last = k
                    return k
            return None
        among = [0, 1] if self.policy == "lw_wait" else free
        if not among:
            return None
        best = min(among, key=lambda k: (self.work(self.replicas[k], now), k))
        return best if best in free else None

    def start(self, k: int, now: float) -> None:
        r = self.replicas[k]
        if r.running is None and r.queue:
            r.running, r.started = r.queue.popleft(), now
            heapq.heappush(self.events, (now + self.costs[r.running], END, k))

    def dispatch(self, now: float) -> None:
        while self.waiting:
            j = self.next_index(now)
            i = self.waiting[j]
            k = self.pick(i, now)
            if k is None:
                self.wake_when_under(i, now)
                return
            self.waiting.pop(j)
            r = self.replicas[k]
            r.held += 1
            r.landing += self.costs[i]
            heapq.heappush(self.events, (now + self.gap, LAND, k * len(self.costs) + i))

    def wake_when_under(self, i: int, now: float) -> None:
        """A time-based bound: look again when a running request has shrunk under it."""
        bound = self.bound(i)
        if bound in (0.0, math.inf):
            return
        for r in self.replicas:
            if r.held < self.cap and r.running is not None:
                at = now + self.work(r, now) - bound
                if at > now:
                    heapq.heappush(self.events, (at + 1e-9, TIMER, -1))

    def run(self) -> list[float]:
        """Each request's completion time."""
        n = len(self.costs)
        done = [0.0] * n
        self.events = [(t, ARRIVE, i) for i, t in enumerate(self.arrive)]
        heapq.heapify(self.events)
        while self.events:
            now, kind, ident = heapq.heappop(self.events)
            if kind == ARRIVE:
                self.waiting.append(ident)
            elif kind == END:
                r = self.replicas[ident]
                assert r.running is not None
                done[r.running], r.running = now, None
                r.held -= 1
                self.start(ident, now)
            elif kind == LAND:
                k, i = divmod(ident, n)
                r = self.replicas[k]
                r.landing -= self.costs[i]
                r.queue.append(i)
                self.start(k, now)
            self.dispatch(now)
        return done


@dataclass(frozen=True)
class Figures:
    p50: float
    p99: float
    large_p99: float
    tput: float  # requests per second, saturated


def _draw(
    rng: random.Random, count: int, rate: float, small_s: float, large_s: float, share: float
) -> tuple[list[float], list[float]]:
    at, arrive, costs = 0.0, [], []
    for _ in range(count):
        at += rng.expovariate(rate) if rate > 0 else 0.0
        arrive.append(at)
        costs.append(large_s if rng.random() < share else small_s)
    return arrive, costs


def simulate(
    policy: str,
    load: float,
    small_s: float,
    large_s: float,
    cap: int,
    count: int,
    seed: int,
    gap: float = 0.005,
    age: float = 10.0,
    mean_frac: float = 1.0,
    large_share: float = 0.2,
) -> Figures:
    mean = (1 - large_share) * small_s + large_share * large_s

    def sim(arrive: list[float], costs: list[float]) -> _Sim:
        return _Sim(policy, cap, gap, age, mean_frac * mean, costs, arrive)

    rate = load * 2 / mean
    arrive, costs = _draw(random.Random(seed), count, rate, small_s, large_s, large_share)
    done = sim(arrive, costs).run()
    kept = range(count // 10, count)
    every = sorted(done[i] - arrive[i] for i in kept)
    large = sorted(done[i] - arrive[i] for i in kept if costs[i] == large_s)
    burst, burst_costs = _draw(random.Random(seed), count // 10, 0.0, small_s, large_s, large_share)
    tput = len(burst) / max(sim(burst, burst_costs).run())
    return Figures(_pct(every, 0.5), _pct(every, 0.99), _pct(large, 0.99), tput)


def _pct(ordered: list[float], q: float) -> float:
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def averaged(policy: str, load: float, ratio: float, cap: int, args: argparse.Namespace) -> Figures:
    runs = [
        simulate(
            policy,
            load,
            0.5,
            0.5 * ratio,
            cap,
            args.count,
            seed,
            args.gap_ms / 1e3,
            args.age,
            args.mean_frac,
        )
        for seed in range(args.seed, args.seed + args.seeds)
    ]
    return Figures(
        *(
            statistics.fmean(getattr(r, f) for r in runs)
            for f in ("p50", "p99", "large_p99", "tput")
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--count", type=int, default=20000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--seeds", type=int, default=3, help="runs averaged per figure")
    parser.add_argument("--gap-ms", type=float, default=5.0, help="router round trip")
    parser.add_argument("--age", type=float, default=10.0, help="sjf_aged's bound, seconds")
    parser.add_argument("--mean-frac", type=float, default=1.0, help="late_mean's bound")
    args = parser.parse_args()
    last: dict[str, Figures] = {}
    for load in (0.6, 0.7, 0.8):
        row = {policy: averaged(policy, load, 15, 2, args) for policy in CANDIDATES}
        rr = row["rr"]
        for policy, f in row.items():
            print(
                f"load={load} large/small=15 cap=2 {policy}: p50={f.p50:.2f}s p99={f.p99:.2f}s "
                f"large_p99={f.large_p99:.2f}s p99_gain={rr.p99 / f.p99:.2f} "
                f"saturated_tput_gain={f.tput / rr.tput:.3f}"
            )
        last = row if load == 0.7 else last
    configs = [(load, ratio, 2) for load in (0.7, 0.6) for ratio in (10, 20)]
    configs += [(0.7, 15, cap) for cap in (1, 4, 8)]
    for load, ratio, cap in configs:
        row = {
            policy: averaged(policy, load, ratio, cap, args) for policy in ("rr", "lw", "lw_wait")
        }
        cells = " ".join(f"{k} p50={v.p50:.2f}s p99={v.p99:.2f}s" for k, v in row.items())
        gains = " ".join(f"{k}={row['rr'].p99 / row[k].p99:.2f}" for k in ("lw", "lw_wait"))
        print(f"load={load} large/small={ratio} cap={cap}: {cells} | p99 gain {gains}")
    rr = last["rr"]
    gains = " ".join(
        f"sim_p99_gain_{k}={rr.p99 / last[k].p99:.2f}"
        for k in ("lw", "late_own", "late_mean", "late_idle", "sjf_aged")
    )
    print(f"{gains} sim_tput_gain_late_idle={last['late_idle'].tput / rr.tput:.3f}")


if __name__ == "__main__":
    main()
