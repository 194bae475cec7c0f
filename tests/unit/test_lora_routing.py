"""Adapter-aware least work (docs/lora.md, Routing that knows): the pure parts.

The policy over estimates that carry an adapter load; the trail of adapters a ping
cannot show yet; the load time's fallbacks. The same choice through a router with two
stub replicas is in tests/unit/test_router_lora.py.
"""

from __future__ import annotations

from collections import Counter

from dpserve.contract import protocol as p
from dpserve.contract.protocol import LoraRef
from dpserve.router.adapters import (
    DEFAULT_ADAPTER_LOAD_S,
    AdapterTrail,
    adapters_key,
    evicts,
    load_seconds,
    miss_seconds,
    missing,
    names_of,
)
from dpserve.router.policies import Estimate, LeastWork, RoundRobin, hrw_owner

A, B, C = "tcp://a:1", "tcp://b:1", "tcp://c:1"


def _pick(policy: LeastWork, estimates: dict[str, Estimate], times: int = 1) -> list[str | None]:
    return [policy.pick(estimates, lambda k: True, estimates.__getitem__) for _ in range(times)]


def test_an_idle_holder_wins_over_an_idle_replica_that_must_load_every_time() -> None:
    # Both idle: without adapters they would take turns; the loader's load decides.
    estimates = {A: Estimate(0.0, 1.0, load_s=0.5), B: Estimate(0.0, 1.0)}
    assert _pick(LeastWork(), estimates, 6) == [B] * 6


def test_a_holder_buried_in_work_loses_to_an_idle_replica_that_loads() -> None:
    estimates = {A: Estimate(10.0, 1.0), B: Estimate(0.0, 1.0, load_s=0.5)}
    assert _pick(LeastWork(), estimates, 3) == [B] * 3


def test_a_holder_with_a_little_work_ahead_beats_a_load_that_costs_more() -> None:
    estimates = {A: Estimate(0.2, 1.0), B: Estimate(0.0, 1.0, load_s=2.0)}
    assert _pick(LeastWork(), estimates, 3) == [A] * 3


def _gather(policy: LeastWork, estimates: dict[str, Estimate], key: str, times: int) -> list:
    return [
        policy.pick(estimates, lambda k: True, estimates.__getitem__, key) for _ in range(times)
    ]


def test_where_none_holds_an_adapter_its_home_loads_it_the_same_from_every_router() -> None:
    cold = {k: Estimate(0.0, 1.0, load_s=0.5) for k in (A, B, C)}
    for name in ("ink", "wash", "style-7"):
        home = hrw_owner(name, cold)
        assert _gather(LeastWork(), cold, name, 5) == [home] * 5
        assert _gather(LeastWork(), cold, name, 1) == [home]  # another router: the same
    homes = Counter(hrw_owner(f"style-{i}", cold) for i in range(30))
    assert set(homes) == {A, B, C}  # the adapters split between the replicas
    # Without adapters to gather (or adapter-blind), replicas that must load take turns.
    assert Counter(_pick(LeastWork(), cold, 9)) == {A: 3, B: 3, C: 3}


def test_within_the_tie_a_holder_keeps_its_adapters_requests() -> None:
    # The holder has a little work ahead, less than a quarter of the request: it keeps
    # it, where adapter-blind turns would load it on the idle one every other time.
    near = {A: Estimate(0.1, 1.0), B: Estimate(0.0, 1.0, load_s=0.05)}
    assert _gather(LeastWork(), near, "ink", 4) == [A] * 4
    assert Counter(_pick(LeastWork(), near, 4)) == {A: 2, B: 2}
    # Holders alike take turns: gathering never piles onto one of them.
    holders = {A: Estimate(0.1, 1.0), B: Estimate(0.1, 1.0), C: Estimate(0.0, 1.0, load_s=0.05)}
    assert Counter(_gather(LeastWork(), holders, "ink", 4)) == {A: 2, B: 2}


def test_fewer_missing_adapters_win() -> None:
    estimates = {A: Estimate(0.0, 1.0, load_s=1.0), B: Estimate(0.0, 1.0, load_s=0.5)}
    assert _pick(LeastWork(), estimates, 3) == [B] * 3


def test_without_adapter_loads_least_work_is_as_before() -> None:
    idle = {A: Estimate(0.0, 5.0), B: Estimate(0.0, 1.0)}
    assert Counter(_pick(LeastWork(), idle, 4)) == {A: 2, B: 2}  # idle ones take turns


def test_round_robin_ignores_adapters() -> None:
    estimates = {A: Estimate(0.0, 1.0, load_s=5.0), B: Estimate(0.0, 1.0)}
    rr = RoundRobin()
    picks = [rr.pick(estimates, lambda k: True, estimates.__getitem__) for _ in range(4)]
    assert picks == [A, B, A, B]


def test_finish_counts_the_load() -> None:
    assert Estimate(1.0, 2.0, 0.5).finish_s == 3.5
    assert Estimate(1.0, 2.0).finish_s == 3.0


def test_the_trail_holds_what_a_ping_cannot_show_yet() -> None:
    trail = AdapterTrail()
    assert trail.present(["x"]) == {"x"}
    trail.sent(["ink", "wash"])
    assert trail.present([]) == {"ink", "wash"}  # in flight: loaded before our next one
    trail.pinged(asked_at=5.0)  # a ping while they run: still in flight
    assert trail.present([]) == {"ink", "wash"}
    trail.answered(["ink", "wash"], now=10.0)
    trail.pinged(asked_at=9.0)  # asked before the answer: its report may predate the load
    assert trail.present([]) == {"ink", "wash"}
    trail.pinged(asked_at=11.0)  # asked after: its report is the truth (resident or evicted)
    assert trail.present([]) == set()
    assert trail.present(["ink"]) == {"ink"}


def test_the_trail_counts_requests_in_flight_per_adapter() -> None:
    trail = AdapterTrail()
    trail.sent(["ink"])
    trail.sent(["ink"])
    trail.answered(["ink"], now=1.0)
    trail.pinged(asked_at=2.0)
    assert trail.present([]) == {"ink"}  # the second is still in flight
    trail.answered(["ink"], now=3.0)
    trail.pinged(asked_at=4.0)
    assert trail.present([]) == set()


def test_load_time_is_measured_else_the_fleets_median_else_a_default() -> None:
    assert load_seconds(0, None, []) == 0.0
    assert load_seconds(2, 0.3, [9.0]) == 0.6
    assert load_seconds(1, None, [0.2, None, 0.4, 0.9]) == 0.4
    assert load_seconds(3, None, [None]) == 3 * DEFAULT_ADAPTER_LOAD_S


def test_an_adapter_sets_key_ignores_order_and_scale() -> None:
    one = [LoraRef(name="b", scale=0.5), LoraRef(name="a")]
    assert adapters_key(one) == adapters_key([LoraRef(name="a"), LoraRef(name="b", scale=2)])
    assert adapters_key(one) != adapters_key([LoraRef(name="a")])


def test_missing_keeps_the_requests_order() -> None:
    refs = [LoraRef(name="b"), LoraRef(name="a"), LoraRef(name="c")]
    assert missing(refs, {"a"}) == ["b", "c"]
    assert missing(None, set()) == []
    assert names_of(refs) == ("b", "a", "c")


def test_a_load_into_a_full_cache_counts_twice() -> None:
    room = p.AdapterReport(resident=["a"], capacity_bytes=30, used_bytes=10)
    full = p.AdapterReport(resident=["a", "b", "c"], capacity_bytes=30, used_bytes=25)
    assert not evicts(room) and evicts(full)
    assert not evicts(None) and not evicts(p.AdapterReport())  # nothing held: room
    assert miss_seconds(0.4, evicting=True) == 0.8
    assert miss_seconds(0.4, evicting=False) == 0.4
