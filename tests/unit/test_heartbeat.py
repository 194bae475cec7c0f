"""The supervisor's judgement of its ranks' heartbeats, on a fake clock."""

from __future__ import annotations

import multiprocessing as mp
import time

from dpserve.worker.heartbeat import HangCheck, Heartbeats
from tests.polling import eventually


def _gang(ranks: int, at: float) -> Heartbeats:
    beats = Heartbeats(mp.get_context("spawn"), ranks)
    for rank in range(ranks):
        beats._slots[rank] = at  # as if each had just beaten
    return beats


def test_a_rank_silent_past_the_timeout_is_named_with_its_silence() -> None:
    beats = _gang(2, at=100.0)
    check = HangCheck(beats, timeout_s=10.0, now=100.0)
    for now in (102.0, 104.0, 106.0, 108.0):
        beats._slots[0] = now  # rank 0 keeps beating, rank 1 stopped at 100
        assert check.hung([0, 1], now) is None
    beats._slots[0] = 110.5
    assert check.hung([0, 1], 110.5) == (1, 10.5)


def test_ranks_that_exited_are_not_judged() -> None:
    beats = _gang(2, at=100.0)
    check = HangCheck(beats, timeout_s=10.0, now=100.0)
    for now in (104.0, 108.0, 112.0):
        beats._slots[0] = now
        assert check.hung([0], now) is None  # rank 1 stopped cleanly: it beats no more


def test_silence_while_the_supervisor_itself_was_frozen_is_forgiven() -> None:
    beats = _gang(2, at=100.0)
    check = HangCheck(beats, timeout_s=10.0, now=100.0)
    # The machine slept for a minute: every slot is a minute old when we wake.
    assert check.hung([0, 1], 160.0) is None
    for now in range(161, 171):  # each rank gets a whole timeout to beat again
        beats._slots[0] = now
        assert check.hung([0, 1], now) is None
    assert check.hung([0, 1], 170.5) == (1, 10.5)  # rank 1 never came back


def test_a_rank_beats_from_its_own_thread() -> None:
    beats = Heartbeats(mp.get_context("spawn"), 1)
    beats.started(0)
    first = float(beats._slots[0])
    beats.beat_forever(0, timeout_s=0.5)  # a beat every 50 ms
    # Still beating three beats on: the thread loops, it did not write once and stop.
    eventually(lambda: beats._slots[0] > first + 0.15, timeout_s=10, poll_s=0.01)
    assert beats.silent_for(0, time.monotonic()) < 0.2
