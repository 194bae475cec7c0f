"""The fair-share policy alone (dpserve/router/fair.py): the order waiters are served in,
whose waiter a full queue drops, and which weights a router accepts. No asyncio: a
queue is a list of tags, served smallest first, as Admission serves its waiters."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import pytest

from dpserve.router.fair import FairClock, Tag, check_weights, over_share


@dataclass
class _Queue:
    """Waiters as Admission keeps them: served by start tag, then arrival."""

    clock: FairClock = field(default_factory=FairClock)
    waiting: list[tuple[float, int, Tag, str]] = field(default_factory=list)
    arrivals: int = 0

    def arrive(self, tenant: str, units: float = 1.0, times: int = 1) -> None:
        for _ in range(times):
            self.arrivals += 1
            tag = self.clock.arrive(tenant, units)
            self.waiting.append((tag.start, self.arrivals, tag, tenant))

    def serve(self, n: int) -> list[str]:
        self.waiting.sort(key=lambda w: w[:2])
        served, self.waiting = self.waiting[:n], self.waiting[n:]
        for _, _, tag, _ in served:
            self.clock.started(tag)
        return [tenant for *_, tenant in served]


def test_one_tenant_is_served_in_arrival_order() -> None:
    clock = FairClock()
    tags = [clock.arrive("default", units) for units in (5.0, 1.0, 3.0, 0.0)]
    assert [t.start for t in tags] == sorted(t.start for t in tags)
    assert all(a.finish <= b.start for a, b in itertools.pairwise(tags))


def test_a_light_tenant_goes_ahead_of_a_flooders_backlog() -> None:
    queue = _Queue()
    queue.arrive("heavy", times=50)
    assert queue.serve(2) == ["heavy", "heavy"]
    queue.arrive("light")
    # Behind at most the heavy waiter already level with the clock, never its backlog.
    assert "light" in queue.serve(2)


def test_backlogged_tenants_share_by_cost_over_weight() -> None:
    # a: weight 3, requests of 1 unit; b: weight 1, requests of 1 unit; c: weight 1,
    # requests of 4 units. Served per unit of virtual time: a 3, b 1, c 1/4.
    queue = _Queue(FairClock({"a": 3}))
    for _ in range(200):
        queue.arrive("a")
        queue.arrive("b")
        queue.arrive("c", 4.0)
    served = queue.serve(170)
    counts = {t: served.count(t) for t in "abc"}
    assert counts["a"] == pytest.approx(3 * counts["b"], abs=3)
    assert counts["b"] == pytest.approx(4 * counts["c"], abs=4)


def test_a_tenant_idle_for_a_while_banks_no_credit() -> None:
    queue = _Queue()
    queue.arrive("light")
    queue.serve(1)
    queue.arrive("heavy", times=30)
    queue.serve(20)  # the clock moves on while light sends nothing
    queue.arrive("light", times=10)
    # light now alternates with heavy; it does not take the next ten slots in a row.
    assert queue.serve(10).count("light") <= 6


def test_a_refused_waiter_gives_its_charge_back() -> None:
    clock = FairClock()
    clock.arrive("t", 2.0)
    last = clock.arrive("t", 2.0)
    clock.refund("t", last)
    assert clock.arrive("t", 1.0).start == last.start


def test_a_full_queue_drops_the_newest_of_the_tenant_most_over_its_share() -> None:
    assert over_share({"heavy": 10}, {}, "light") == "heavy"
    assert over_share({"heavy": 6, "light": 4}, {}, "light") == "heavy"
    assert over_share({"heavy": 5, "light": 5}, {}, "light") is None  # level: refused
    assert over_share({"heavy": 10}, {}, "heavy") is None  # its own flood
    assert over_share({}, {}, "x") is None
    # Weighted: a (3) holding 6 is at 2 per weight, under b's 4 with one more.
    assert over_share({"a": 6, "b": 3}, {"a": 3}, "b") is None
    assert over_share({"a": 6, "b": 3}, {"a": 3}, "c") == "b"


def test_weights_name_configured_tenants_only() -> None:
    check_weights({"team-a": 2}, ["team-a", "team-b"])
    check_weights({}, [])
    with pytest.raises(ValueError, match=r"team-c, which no key names; the tenants are team-a"):
        check_weights({"team-c": 2}, ["team-a"])
    with pytest.raises(ValueError, match="no API keys are configured"):
        check_weights({"team-a": 2}, [])
