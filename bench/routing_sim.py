"""What routing can gain under a mixed load, by discrete-event simulation (no replicas).

Two replicas each run one request at a time from their own FIFO; the router holds at
most ``cap`` requests per replica (running + queued there) and the rest in its own
FIFO, which it serves in order whenever a slot frees. Arrivals are Poisson at
``load`` of the pair's capacity; 80 % small requests (``small_s``), 20 % large
(``large_s``); service times are exact (the estimates are perfect: an upper bound
on what a cost model can do). Policies: round-robin over replicas with a free slot
(``rr``), least outstanding work among those (``lw``, what dpserve's LeastWork does),
and least work waiting for a full replica when it would finish there first, the
router queue served strictly in order (``lw_wait``). Latency counts from arrival;
the first 10 % of requests are left out (warm-up). docs/router.md, Routing policies,
quotes this. Last line: ``sim_p99_gain_lw=<rr/lw> sim_p99_gain_lw_wait=<rr/lw_wait>``
for the first configuration.
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
from collections import deque
from dataclasses import dataclass, field


@dataclass
class _Replica:
    queue: deque[int] = field(default_factory=deque)  # request indexes, FIFO
    running: int | None = None
    busy_until: float = 0.0

    def inflight(self) -> int:
        return len(self.queue) + (self.running is not None)


def simulate(
    policy: str,
    load: float,
    small_s: float,
    large_s: float,
    cap: int,
    count: int,
    seed: int,
    large_share: float = 0.2,
) -> tuple[float, float]:
    """(p50, p99) latency in seconds."""
    rng = random.Random(seed)
    rate = load * 2 / ((1 - large_share) * small_s + large_share * large_s)
    at, costs, arrive = 0.0, [], []
    for _ in range(count):
        at += rng.expovariate(rate)
        arrive.append(at)
        costs.append(large_s if rng.random() < large_share else small_s)
    replicas = [_Replica(), _Replica()]
    waiting: deque[int] = deque()
    done = [0.0] * count
    events = [(t, 1, i) for i, t in enumerate(arrive)]  # (time, kind 1 arrival / 0 end, id)
    heapq.heapify(events)
    last = [1]  # round-robin cursor

    def work(r: _Replica, now: float) -> float:
        running = max(0.0, r.busy_until - now) if r.running is not None else 0.0
        return running + sum(costs[i] for i in r.queue)

    def pick(now: float) -> int | None:
        free = [k for k in (0, 1) if replicas[k].inflight() < cap]
        if policy == "rr":
            for step in (1, 2):
                k = (last[0] + step) % 2
                if k in free:
                    last[0] = k
                    return k
            return None
        among = free if policy == "lw" else [0, 1]
        if not among:
            return None
        best = min(among, key=lambda k: (work(replicas[k], now), k))
        return best if best in free else None

    def start(k: int, now: float) -> None:
        r = replicas[k]
        if r.running is None and r.queue:
            r.running = r.queue.popleft()
            r.busy_until = now + costs[r.running]
            heapq.heappush(events, (r.busy_until, 0, k))

    def dispatch(now: float) -> None:
        while waiting and (k := pick(now)) is not None:
            replicas[k].queue.append(waiting.popleft())
            start(k, now)

    while events:
        now, kind, ident = heapq.heappop(events)
        if kind == 1:
            waiting.append(ident)
        else:
            r = replicas[ident]
            assert r.running is not None
            done[r.running], r.running = now, None
            start(ident, now)
        dispatch(now)
    latencies = sorted(d - a for d, a in list(zip(done, arrive, strict=True))[count // 10 :])
    return latencies[len(latencies) // 2], latencies[math.ceil(0.99 * len(latencies)) - 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--count", type=int, default=20000)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    first: dict[str, float] = {}
    configs = [(load, ratio, 2) for load in (0.7, 0.6) for ratio in (15, 10, 20)]
    configs += [(0.7, 15, cap) for cap in (1, 4, 8)]
    for load, ratio, cap in configs:
        row = {}
        for policy in ("rr", "lw", "lw_wait"):
            row[policy] = simulate(policy, load, 0.5, 0.5 * ratio, cap, args.count, args.seed)
        first = first or {k: v[1] for k, v in row.items()}
        cells = " ".join(f"{k} p50={v[0]:.2f}s p99={v[1]:.2f}s" for k, v in row.items())
        gains = " ".join(f"{k}={row['rr'][1] / row[k][1]:.2f}" for k in ("lw", "lw_wait"))
        print(f"load={load} large/small={ratio} cap={cap}: {cells} | p99 gain {gains}")
    print(
        f"sim_p99_gain_lw={first['rr'] / first['lw']:.2f} "
        f"sim_p99_gain_lw_wait={first['rr'] / first['lw_wait']:.2f}"
    )


if __name__ == "__main__":
    main()
