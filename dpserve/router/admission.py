"""Admission and placement: which serving replica takes a request, and who waits.

:class:`Admission` owns this router's work on each replica (``inflight``, its
``ledger`` of estimated work, ``served``, and the session count between pings) and
the bounded FIFO of requests waiting for a slot. A generation takes a slot on a
serving replica (the routing policy picks: least estimated work, or round-robin;
at most ``max_inflight`` x the replica's batch size each) or waits its turn; 429
when ``max_queue`` already wait. A video job is placed at once, past the cap
(:meth:`place`). Each slot carries the request's estimated cost
(dpserve/router/load.py), so the pool knows every replica's outstanding work.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable

from dpserve.contract import protocol as p
from dpserve.router.load import Load
from dpserve.router.membership import Membership
from dpserve.router.policies import Estimate, PolicyName, make_policy
from dpserve.router.replica import Replica, Slot
from dpserve.router.waiting import wait_within


class Admission:
    def __init__(
        self,
        members: Membership,
        load: Load,
        policy: PolicyName,
        max_inflight: int,
        max_queue: int,
    ) -> None:
        self.members = members
        self.load = load
        self.max_inflight = max_inflight
        self.max_queue = max_queue
        self._policy = make_policy(policy)
        self._tickets = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def queue_depth(self) -> int:
        return len(self._waiters)

    def cap(self, replica: Replica) -> int:
        return self.max_inflight * replica.max_batch

    def _there(self, params: p.GenerateParams) -> Callable[[str], Estimate]:
        """A member's outstanding work and this request's estimate on it, as of now."""
        replicas, now = self.members.replicas, time.monotonic()

        def there(endpoint: str) -> Estimate:
            replica = replicas[endpoint]
            outstanding = self.load.outstanding_s(replica, now)
            return Estimate(outstanding, self.load.estimate(replica, params)[1])

        return there

    def _serving(self) -> list[str]:
        return [r.endpoint for r in self.members.serving()]

    def _pick(self, avoid: set[str], params: p.GenerateParams) -> Replica | None:
        replicas = self.members.replicas

        def free(endpoint: str, allow_avoided: bool) -> bool:
            r = replicas[endpoint]
            ok = r.serving and r.inflight < self.cap(r)
            return ok and (allow_avoided or endpoint not in avoid)

        there = self._there(params)
        key = self._policy.pick(replicas, lambda e: free(e, False), there)
        # A retry prefers another replica, but takes the same one if it is the only one.
        if key is None and avoid and not any(e not in avoid for e in self._serving()):
            key = self._policy.pick(replicas, lambda e: free(e, True), there)
        return replicas[key] if key is not None else None

    async def acquire(self, avoid: set[str], timeout_s: float, params: p.GenerateParams) -> Slot:
        """A slot on a serving replica for ``params``, waiting in FIFO order; 429 when
        the queue is full."""
        deadline = time.monotonic() + timeout_s
        while True:
            replica = self._pick(avoid, params)
            if replica is not None:
                return self.take(replica, params)
            if len(self._waiters) >= self.max_queue:
                raise p.RequestError(
                    p.OVERLOADED, f"all replicas are busy and {len(self._waiters)} requests wait"
                )
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await wait_within(waiter, deadline - time.monotonic())
            except TimeoutError:
                raise p.RequestError(
                    p.UNAVAILABLE, f"no replica could take the request within {timeout_s:.0f}s"
                ) from None
            finally:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)

    def place(self, avoid: set[str], params: p.GenerateParams) -> Slot:
        """A slot for a video job (dpserve/router/videos.py): the policy's pick among
        serving replicas, at once, past the in-flight cap. A job API answers at once and
        the job queues at its replica, whose --max-queue bounds it; its slot puts its
        work in the replica's ledger, so image requests and the autoscaling gauges see
        it. Another replica than ``avoid`` when one serves; 503 when none does."""
        replicas = self.members.replicas
        there = self._there(params)
        serving = set(self._serving())
        fresh = serving - avoid
        key = self._policy.pick(replicas, lambda e: e in fresh, there)
        if key is None:
            key = self._policy.pick(replicas, lambda e: e in serving, there)
        if key is None:
            raise p.RequestError(p.UNAVAILABLE, "no replica is serving yet; retry shortly")
        return self.take(replicas[key], params)

    def take(self, replica: Replica, params: p.GenerateParams) -> Slot:
        """A slot on ``replica``, whatever its load (the callers chose it)."""
        replica.inflight += 1
        units, seconds = self.load.estimate(replica, params)
        self._tickets += 1
        replica.ledger.add(self._tickets, units, seconds, time.monotonic())
        return Slot(replica, self._tickets, units, seconds)

    def release(self, slot: Slot) -> None:
        """The slot's request was answered (or failed): its work leaves the replica."""
        slot.replica.inflight -= 1
        slot.replica.ledger.remove(slot.ticket, time.monotonic())
        self.wake()

    def note_served(self, replica: Replica) -> None:
        replica.served += 1

    def wake(self) -> None:
        """Capacity may have freed (a slot released, a replica joined rotation): every
        waiter picks again, in FIFO order."""
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)

    # ------------------------------------------------------------ realtime sessions

    def session_opened(self, replica: Replica) -> None:
        replica.sessions += 1

    def session_closed(self, replica: Replica) -> None:
        replica.sessions = max(0, replica.sessions - 1)

    def session_refused(self, replica: Replica) -> None:
        replica.sessions = max(replica.sessions, replica.max_sessions)  # until its next ping
