"""Heartbeats of a gang's ranks, read by their supervisor without asking the ranks.

The supervisor shares one slot per rank (shared memory, no lock: each slot has
one writer). A daemon thread in every rank writes ``time.monotonic()`` (one clock
for all processes of a host) into its slot, from before the model loads until the
rank exits. A stopped (SIGSTOP) or frozen process runs none of its threads, so its
slot goes stale; a rank busy in a long step or waiting in a collective keeps
beating, because torch and the collective libraries release the GIL.

This catches what the gang's own collectives cannot: a rank that is stopped while
the gang idles is never waited on (idle ticks are broadcasts, which do not block
on their receivers), and one stopped mid-generation blocks the others for the
whole collective timeout.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Iterable
from multiprocessing.context import BaseContext
from typing import Any

# Beats per timeout: a missed beat or two (a busy machine) is far from stale.
_BEATS_PER_TIMEOUT = 10


class Heartbeats:
    """One slot per rank; picklable into spawn children as a Process argument."""

    def __init__(self, ctx: BaseContext, ranks: int) -> None:
        self._slots: Any = ctx.RawArray(ctypes.c_double, ranks)

    def started(self, rank: int) -> None:
        """The supervisor started ``rank``: its silence counts from now."""
        self._slots[rank] = time.monotonic()

    def beat_forever(self, rank: int, timeout_s: float) -> threading.Thread:
        """In the rank: keep its slot fresh from a daemon thread (it dies with the rank)."""
        interval = min(1.0, timeout_s / _BEATS_PER_TIMEOUT)

        def beat() -> None:
            while True:
                self._slots[rank] = time.monotonic()
                time.sleep(interval)

        thread = threading.Thread(target=beat, name=f"dpserve-heartbeat-{rank}", daemon=True)
        thread.start()
        return thread

    def silent_for(self, rank: int, now: float) -> float:
        return now - float(self._slots[rank])


class HangCheck:
    """The supervisor's judgement: which live rank has been silent past the timeout.

    Silence while the supervisor itself did not run (a suspended machine, a paused
    container: every process froze at once) is forgiven, so waking up never kills
    a healthy gang.
    """

    def __init__(self, beats: Heartbeats, timeout_s: float, now: float) -> None:
        self.beats = beats
        self.timeout_s = timeout_s
        self._last_look = now
        self._forgiven_until = now

    def hung(self, alive: Iterable[int], now: float) -> tuple[int, float] | None:
        """``(rank, seconds silent)`` of the stalest rank past the timeout, else None."""
        if now - self._last_look > self.timeout_s / 2:  # we were frozen too
            self._forgiven_until = now
        self._last_look = now
        ages = [(min(self.beats.silent_for(r, now), now - self._forgiven_until), r) for r in alive]
        if not ages:
            return None
        age, rank = max(ages)
        return (rank, age) if age > self.timeout_s else None
