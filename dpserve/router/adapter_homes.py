"""Where each adapter set lives in the fleet: homes placed by demand (docs/lora.md).

A rendezvous hash splits adapters between caches evenly by count, blind to demand:
with a Zipf mix, each cache then holds a few hot adapters and churns on cold ones,
and every cold load evicts a hot one. :func:`place` instead ranks the adapter sets by
recent demand (:class:`AdapterDemand`, the router's own requests) and gives the
hottest to **clean** replicas, each at most as many as its cache holds and at most
``CLEAN_SHARE / N`` of the demand, so their caches never churn; everything else goes
to one **churn** replica, whose cache turns over on the tail. The churn replica does
the loads, so it gets less demand than an even split (``CLEAN_SHARE`` > 1).

Measured in bench/lora_sim.py on bench/lora_mix.py's mix: see docs/lora.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Final

# A clean replica takes up to this over N of the demand; the churn replica the rest.
CLEAN_SHARE: Final = 1.4
# Demand halves every this many adapter requests: a placement follows a shifting mix
# within a few thousand requests, and the sets near the clean cache's edge do not flap
# on a sample's noise (at 200, two routers sharing a mix often disagreed on them).
HALF_LIFE_REQUESTS: Final = 1000
# Homes are placed again after this many adapter requests, or when the fleet changes.
REPLACE_EVERY: Final = 16
_PRUNE_BELOW: Final = 1e-4  # of the newest request's weight: a set long out of demand


def place(
    demand: Mapping[str, float], replicas: Sequence[str], slots: Mapping[str, int]
) -> dict[str, str]:
    """Each demanded adapter set's home replica. ``slots``: how many adapter sets each
    replica's cache holds. Deterministic for the same demand and replicas, so routers
    that see the same mix agree; ties break by name."""
    order = sorted(demand, key=lambda k: (-demand[k], k))
    keys = sorted(replicas)
    if not keys:
        return {}
    if len(order) <= sum(slots.get(k, 0) for k in keys):
        return _spread(order, demand, keys, slots)
    clean, churn = keys[:-1], keys[-1]
    target = CLEAN_SHARE / len(keys) * sum(demand.values())
    held = dict.fromkeys(clean, 0.0)
    count = dict.fromkeys(clean, 0)
    homes: dict[str, str] = {}
    for name in order:
        fits = [k for k in clean if count[k] < slots.get(k, 0) and held[k] + demand[name] <= target]
        home = min(fits, key=lambda k: (held[k], k)) if fits else churn
        if fits:
            held[home] += demand[name]
            count[home] += 1
        homes[name] = home
    return homes


def _spread(
    order: list[str], demand: Mapping[str, float], keys: list[str], slots: Mapping[str, int]
) -> dict[str, str]:
    """Every set fits some cache: hottest first, each to the least loaded with room."""
    held = dict.fromkeys(keys, 0.0)
    count = dict.fromkeys(keys, 0)
    homes: dict[str, str] = {}
    for name in order:
        home = min((k for k in keys if count[k] < slots.get(k, 0)), key=lambda k: (held[k], k))
        held[home] += demand[name]
        count[home] += 1
        homes[name] = home
    return homes


class AdapterDemand:
    """Recent demand per adapter set, decaying by request count (not time, so an idle
    spell keeps the last mix). Each request adds a weight that grows by the decay's
    inverse, which is the same as decaying every other count, at O(1) a request."""

    def __init__(self, half_life: int = HALF_LIFE_REQUESTS) -> None:
        self._growth = 2.0 ** (1.0 / half_life)
        self._weight = 1.0
        self._counts: dict[str, float] = {}
        self.requests = 0

    def seen(self, key: str) -> None:
        self.requests += 1
        self._weight *= self._growth
        self._counts[key] = self._counts.get(key, 0.0) + self._weight
        if self._weight > 1e12:  # rescale before floats lose the small counts
            self._counts = {k: c / self._weight for k, c in self._counts.items()}
            self._weight = 1.0
            self._counts = {k: c for k, c in self._counts.items() if c >= _PRUNE_BELOW}

    def shares(self) -> dict[str, float]:
        total = sum(self._counts.values())
        return {k: c / total for k, c in self._counts.items()} if total else {}


class AdapterHomes:
    """This router's placement: the demand it saw and the homes placed from it, again
    every ``REPLACE_EVERY`` requests or when the serving replicas or their caches change."""

    def __init__(self) -> None:
        self.demand = AdapterDemand()
        self._homes: dict[str, str] = {}
        self._fleet: tuple[tuple[str, int], ...] = ()
        self._placed_at = -1

    def home(self, key: str, slots: Mapping[str, int]) -> str | None:
        """``key``'s home among the replicas in ``slots`` (those whose caches' size is
        known); None where there is none yet (the caller falls back to a hash)."""
        fleet = tuple(sorted(slots.items()))
        stale = self.demand.requests - self._placed_at >= REPLACE_EVERY
        if fleet != self._fleet or stale or key not in self._homes:
            self._homes = place(self.demand.shares(), list(slots), slots)
            self._fleet, self._placed_at = fleet, self.demand.requests
        return self._homes.get(key)
