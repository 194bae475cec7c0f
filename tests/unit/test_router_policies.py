"""Routing policies: round-robin, least work, rendezvous hashing, fan-out merging."""

from __future__ import annotations

from collections import Counter

import pytest

from dpserve.contract.protocol import (
    ErrorBody,
)
from dpserve.router.policies import (
    UNCALIBRATED_SECONDS_PER_UNIT,
    Estimate,
    LeastWork,
    ReplicaOutcome,
    RoundRobin,
    WorkLedger,
    hrw_owner,
    make_policy,
    measured_seconds_per_unit,
    merge_fanout,
    seconds_per_unit,
)

KEYS = ["tcp://a:1", "tcp://b:1", "tcp://c:1", "tcp://d:1"]


def test_round_robin_covers_every_replica_evenly() -> None:
    rr = RoundRobin()
    picks = [rr.pick(KEYS, lambda k: True) for _ in range(4 * 25)]
    assert Counter(picks) == dict.fromkeys(KEYS, 25)
    assert picks[:4] == sorted(KEYS)


def test_round_robin_skips_ineligible_and_keeps_its_place() -> None:
    rr = RoundRobin()
    down = {"tcp://b:1"}
    picks = [rr.pick(KEYS, lambda k: k not in down) for _ in range(6)]
    assert "tcp://b:1" not in picks
    assert picks == ["tcp://a:1", "tcp://c:1", "tcp://d:1", "tcp://a:1", "tcp://c:1", "tcp://d:1"]
    assert rr.pick(KEYS, lambda k: False) is None


def test_round_robin_survives_membership_changes() -> None:
    rr = RoundRobin()
    assert rr.pick(KEYS, lambda k: True) == "tcp://a:1"
    assert rr.pick(KEYS, lambda k: True) == "tcp://b:1"
    # b leaves, e joins: the cursor continues after b, it does not restart at a.
    keys = ["tcp://a:1", "tcp://c:1", "tcp://d:1", "tcp://e:1"]
    assert rr.pick(keys, lambda k: True) == "tcp://c:1"


def test_dp1_is_the_degenerate_case() -> None:
    rr = RoundRobin()
    assert [rr.pick(["tcp://only:1"], lambda k: True) for _ in range(3)] == ["tcp://only:1"] * 3
    assert rr.pick([], lambda k: True) is None


def test_hrw_is_stable_and_moves_few_sessions() -> None:
    sessions = [f"s{i}" for i in range(400)]
    before = {s: hrw_owner(s, KEYS[:3]) for s in sessions}
    assert set(before.values()) == set(KEYS[:3])
    after = {s: hrw_owner(s, KEYS) for s in sessions}
    moved = [s for s in sessions if before[s] != after[s]]
    assert all(after[s] == KEYS[3] for s in moved)  # only onto the new replica
    assert 0.1 < len(moved) / len(sessions) < 0.4
    assert hrw_owner("x", []) is None


def _ok(name: str, **result: object) -> ReplicaOutcome:
    return ReplicaOutcome(name, result={"replica": name, **result})


def _err(name: str, code: str, message: str) -> ReplicaOutcome:
    return ReplicaOutcome(name, error=ErrorBody(code=code, message=message))


def test_fanout_first_error_wins_with_per_replica_list() -> None:
    outcomes = [
        _ok("0"),
        _err("1", "invalid_request", "no such path"),
        _err("2", "internal", "boom"),
    ]
    answer = merge_fanout("update_weights_from_disk", outcomes, read_only=False)
    assert answer.status == 400
    assert answer.body["success"] is False
    assert answer.body["message"] == "1: no such path"
    assert [r["replica"] for r in answer.body["replicas"]] == ["0", "1", "2"]
    assert [r["ok"] for r in answer.body["replicas"]] == [True, False, False]


def test_fanout_success_and_skipped_replicas() -> None:
    outcomes = [_ok("0"), ReplicaOutcome("1", skipped="down")]
    answer = merge_fanout("set_lora", outcomes, read_only=False)
    assert answer.status == 200 and answer.body["success"] is True
    assert answer.body["replicas"][1]["skipped"] == "down"
    nobody = merge_fanout("set_lora", [ReplicaOutcome("0", skipped="down")], read_only=False)
    assert nobody.status == 503


def test_read_only_fanout_flags_the_odd_replica() -> None:
    outcomes = [_ok("0", loras=["x"]), _ok("1", loras=["y"]), _ok("2", loras=["y"])]
    answer = merge_fanout("list_loras", outcomes, read_only=True)
    assert answer.status == 200
    assert answer.body["consistent"] is False
    assert answer.body["disagreeing_replicas"] == ["0"]
    same = merge_fanout("list_loras", [_ok("0", loras=[]), _ok("1", loras=[])], read_only=True)
    assert same.body["consistent"] is True and same.body["disagreeing_replicas"] == []


# ---------------------------------------------------------------- least work


def test_least_work_picks_the_earliest_finish_among_free_replicas() -> None:
    lw = LeastWork()
    wait = {"tcp://a:1": 9.0, "tcp://b:1": 1.5, "tcp://c:1": 0.5, "tcp://d:1": 3.0}

    def there(k: str) -> Estimate:
        return Estimate(wait[k], 0.1)

    assert lw.pick(KEYS, lambda k: True, there) == "tcp://c:1"
    # A full (or down, or avoided) replica is not waited for, however little its work.
    assert lw.pick(KEYS, lambda k: k != "tcp://c:1", there) == "tcp://b:1"
    assert lw.pick(KEYS, lambda k: False, there) is None
    assert lw.pick([], lambda k: True, there) is None


def test_least_work_ties_take_turns_like_round_robin() -> None:
    lw = LeastWork()
    idle = [lw.pick(KEYS, lambda k: True, lambda k: Estimate(0.0, 1.0)) for _ in range(8)]
    assert Counter(idle) == dict.fromkeys(KEYS, 2)
    near = {"tcp://a:1": 1.0, "tcp://b:1": 1.0 + 1e-4, "tcp://c:1": 2.0, "tcp://d:1": 2.0}
    picks = {lw.pick(KEYS, lambda k: True, lambda k: Estimate(near[k], 0.0)) for _ in range(4)}
    assert picks == {"tcp://a:1", "tcp://b:1"}


def test_idle_replicas_take_turns_whatever_their_calibrations_say() -> None:
    """Sequential requests share idle replicas though one measured twice as fast (a
    loaded host's figure); among busy ones, work ahead worth more than a quarter of
    the request is passed over, less is a tie."""
    lw = LeastWork()
    two = ["tcp://a:1", "tcp://b:1"]
    own = {"tcp://a:1": 1.0, "tcp://b:1": 2.0}
    picks = [lw.pick(two, lambda k: True, lambda k: Estimate(0.0, own[k])) for _ in range(4)]
    assert Counter(picks) == {"tcp://a:1": 2, "tcp://b:1": 2}
    ahead = {"tcp://a:1": 0.0, "tcp://b:1": 0.3}  # b is finishing a request
    picks = [lw.pick(two, lambda k: True, lambda k: Estimate(ahead[k], 1.0)) for _ in range(4)]
    assert set(picks) == {"tcp://a:1"}
    busy = {"tcp://a:1": 5.0, "tcp://b:1": 5.2}  # within a quarter of the request: a tie
    picks = [lw.pick(two, lambda k: True, lambda k: Estimate(busy[k], 1.0)) for _ in range(4)]
    assert Counter(picks) == {"tcp://a:1": 2, "tcp://b:1": 2}
    busy = {"tcp://a:1": 5.0, "tcp://b:1": 6.0}
    picks = [lw.pick(two, lambda k: True, lambda k: Estimate(busy[k], 1.0)) for _ in range(4)]
    assert set(picks) == {"tcp://a:1"}

    # Without estimates it is round-robin.
    assert lw.pick(KEYS, lambda k: True) in KEYS


def test_policies_by_name() -> None:
    assert isinstance(make_policy("least_work"), LeastWork)
    assert isinstance(make_policy("round_robin"), RoundRobin)
    with pytest.raises(ValueError, match="least_work"):
        make_policy("fastest")  # type: ignore[arg-type]


def test_the_ledger_shrinks_the_running_request_and_starts_the_next_at_its_answer() -> None:
    ledger = WorkLedger()
    assert ledger.seconds(0.0) == 0.0 and ledger.units == 0.0 and len(ledger) == 0
    ledger.add(1, units=1.0, seconds=10.0, now=100.0)
    ledger.add(2, units=0.1, seconds=1.0, now=101.0)
    assert ledger.units == pytest.approx(1.1) and len(ledger) == 2
    assert ledger.seconds(101.0) == pytest.approx(10.0)  # 1 s of the first done
    assert ledger.seconds(104.0) == pytest.approx(7.0)
    assert ledger.seconds(130.0) == pytest.approx(1.0)  # overran: only the queued one is left
    ledger.remove(1, now=112.0)  # answered: the second starts now
    assert ledger.seconds(112.5) == pytest.approx(0.5)
    ledger.add(3, units=0.5, seconds=5.0, now=113.0)
    ledger.remove(3, now=114.0)  # answered out of order: the running one's start stands
    assert ledger.seconds(112.5) == pytest.approx(0.5)
    ledger.remove(2, now=115.0)
    ledger.remove(2, now=115.0)  # twice is harmless
    assert ledger.seconds(115.0) == 0.0 and ledger.units == 0.0


def test_an_uncalibrated_replica_borrows_the_others_median_else_plain_units() -> None:
    assert seconds_per_unit(2.0, [5.0]) == 2.0
    assert seconds_per_unit(None, [1.0, None, 3.0, 8.0]) == 3.0
    assert seconds_per_unit(None, [None]) == UNCALIBRATED_SECONDS_PER_UNIT


def test_a_measured_figure_is_none_until_some_replica_has_one() -> None:
    """What a video job's estimate and its bound read: no plain-units stand-in."""
    assert measured_seconds_per_unit(2.0, [5.0]) == 2.0
    assert measured_seconds_per_unit(None, [1.0, None, 3.0]) == 2.0
    assert measured_seconds_per_unit(None, [None, None]) is None
