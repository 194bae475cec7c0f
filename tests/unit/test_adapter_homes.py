"""Adapter homes placed by demand (dpserve/router/adapter_homes.py, docs/lora.md): the
pure placement, the decaying demand, and least work's detour to a home. Through a
router with stub replicas: tests/unit/test_router_lora.py."""

from __future__ import annotations

import random
from collections import Counter

from dpserve.router.adapter_homes import CLEAN_SHARE, AdapterDemand, AdapterHomes, place
from dpserve.router.policies import Estimate, LeastWork

A, B, C = "tcp://a:1", "tcp://b:1", "tcp://c:1"


def _zipf(count: int, s: float = 1.1) -> dict[str, float]:
    weights = {f"style-{k}": 1.0 / (k + 1) ** s for k in range(count)}
    total = sum(weights.values())
    return {k: w / total for k, w in weights.items()}


def test_the_hottest_sets_fill_a_clean_cache_and_the_tail_churns_on_one_replica() -> None:
    demand = _zipf(16)
    homes = place(demand, [B, A], {A: 4, B: 4})
    clean = [k for k, home in homes.items() if home == A]  # the first in key order
    # At most a cache's worth, at most CLEAN_SHARE / N of the demand, hottest first.
    assert clean == ["style-0", "style-1", "style-2", "style-3"]
    assert sum(demand[k] for k in clean) <= CLEAN_SHARE / 2
    assert sorted(homes) == sorted(demand)  # every set has a home; the rest churn on B
    assert Counter(homes.values()) == {A: 4, B: 12}


def test_a_clean_replica_skips_a_set_that_would_take_it_past_its_share() -> None:
    demand = {"hot": 0.5, "warm": 0.3, "a": 0.05, "b": 0.05, "c": 0.05, "d": 0.05}
    homes = place(demand, [A, B], {A: 4, B: 1})
    # hot + warm = 0.8 > 0.7: warm churns, the small ones fill the clean cache.
    assert [k for k, h in homes.items() if h == A] == ["hot", "a", "b", "c"]
    assert {homes["warm"], homes["d"]} == {B}


def test_when_every_set_fits_they_spread_over_all_caches_by_demand() -> None:
    demand = _zipf(6)
    homes = place(demand, [A, B, C], {A: 2, B: 2, C: 2})
    assert Counter(homes.values()) == {A: 2, B: 2, C: 2}
    assert homes["style-0"] != homes["style-1"] != homes["style-2"] != homes["style-0"]


def test_placement_is_the_same_whatever_order_it_is_given_in() -> None:
    demand = _zipf(12)
    reordered = dict(reversed(list(demand.items())))
    assert place(demand, [A, B, C], {A: 3, B: 3, C: 3}) == place(
        reordered, [C, A, B], {C: 3, B: 3, A: 3}
    )
    assert place(demand, [], {}) == {}


def test_demand_halves_every_half_life() -> None:
    demand = AdapterDemand(half_life=100)
    for _ in range(100):
        demand.seen("old")
    for _ in range(100):
        demand.seen("new")
    shares = demand.shares()
    # The old hundred weigh half the new hundred: one third of the demand.
    assert abs(shares["old"] - 1 / 3) < 0.01
    assert AdapterDemand().shares() == {}


def test_demand_rescales_and_forgets_sets_long_out_of_use() -> None:
    demand = AdapterDemand(half_life=1)  # the weight doubles every request
    demand.seen("gone")
    for _ in range(60):  # past the rescale at 2**40
        demand.seen("here")
    shares = demand.shares()
    assert set(shares) == {"here"}
    assert abs(sum(shares.values()) - 1.0) < 1e-9


def test_homes_are_placed_again_when_the_fleet_changes() -> None:
    homes = AdapterHomes()
    for name in ("x", "y"):
        homes.demand.seen(name)
    two = {homes.home(k, {A: 1, B: 1}) for k in ("x", "y")}
    assert two == {A, B}
    assert {homes.home(k, {A: 1}) for k in ("x", "y")} == {A}  # B left
    assert homes.home("x", {}) is None


def _pick(estimates: dict[str, Estimate], home: str | None) -> str | None:
    return LeastWork().pick(estimates, lambda k: True, estimates.__getitem__, "ink", home)


def test_the_home_takes_a_request_within_its_detour_of_the_best() -> None:
    # The home has a request ahead; the other is idle but must load: the home, within
    # home_frac (1.5) of a request.
    busy_home = {A: Estimate(1.0, 1.0, load_s=0.5), B: Estimate(0.0, 1.0, load_s=0.5)}
    assert _pick(busy_home, A) == A
    assert _pick(busy_home, None) == B  # without a home: the least work
    # Two requests ahead is past the detour: the idle one loads it.
    buried = {A: Estimate(2.0, 1.0, load_s=0.5), B: Estimate(0.0, 1.0, load_s=0.5)}
    assert _pick(buried, A) == B
    # An idle holder elsewhere is taken at once, home or not: no load, no wait.
    holder = {A: Estimate(1.0, 1.0), B: Estimate(0.0, 1.0)}
    assert _pick(holder, A) == B


def test_two_routers_seeing_halves_of_one_mix_give_the_hot_sets_the_same_homes() -> None:
    """Behind a load balancer each router sees a sample of the mix: they place the sets
    that matter alike (docs/lora.md, "Several routers")."""
    rng = random.Random(7)
    demand = _zipf(16)
    names, weights = list(demand), list(demand.values())
    routers = (AdapterHomes(), AdapterHomes())
    for _ in range(2000):
        rng.choice(routers).demand.seen(rng.choices(names, weights=weights)[0])
    slots = {A: 4, B: 4}
    one, two = ({k: r.home(k, slots) for k in names} for r in routers)
    assert all(one[k] == two[k] == A for k in names[:3])  # the hottest: the clean cache
    assert sum(one[k] == two[k] for k in names) >= 14  # a set at its edge may differ
