"""Routing policies: round-robin, rendezvous hashing, fan-out merging."""

from __future__ import annotations

from collections import Counter

from dpserve.protocol import ErrorBody
from dpserve.router.policies import ReplicaOutcome, RoundRobin, hrw_owner, merge_fanout

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
