"""Admission and placement: which serving replica takes a request, and who waits.

:class:`Admission` owns this router's work on each replica (``inflight``, its
``ledger`` of estimated work, ``served``, and the session count between pings) and
the bounded queue of requests waiting for a slot. A generation takes a slot on a
serving replica (the routing policy picks: least estimated work, or round-robin;
at most ``max_inflight`` x the replica's batch size each) or waits its turn; 429
when ``max_queue`` already wait. A video job is placed at once, past the cap
(:meth:`place`). Each slot carries the request's estimated cost
(dpserve/router/load.py), so the pool knows every replica's outstanding work.

Between tenants (docs/tenants.md, "Fair shares"): each may hold ``max_per_tenant``
requests in flight or waiting here (a retry of one is not refused), waiters take
freed slots in the fair order of dpserve/router/fair.py (start-time fair queueing
by estimated cost units over the tenant's weight; one tenant: arrival order), and a
full queue makes room for a tenant under its share by refusing the newest waiter of
the one most over it.
"""

from __future__ import annotations

import asyncio
import bisect
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from dpserve.contract import protocol as p
from dpserve.router.adapter_homes import AdapterHomes
from dpserve.router.adapters import HOLDER_CAP_FACTOR, cache_slots, names_of
from dpserve.router.fair import FairClock, Tag, over_share
from dpserve.router.load import Load
from dpserve.router.membership import Membership
from dpserve.router.policies import HOME_SLACK, Estimate, PolicyName, make_policy
from dpserve.router.replica import Replica, Slot
from dpserve.router.tenants import KEYLESS
from dpserve.router.waiting import wait_within


@dataclass(eq=False)
class _Waiter:
    """A request waiting for a slot: :meth:`Admission.wake` hands it one."""

    tenant: str
    tag: Tag
    seq: int
    avoid: set[str]
    params: p.GenerateParams
    future: asyncio.Future[Slot]

    @property
    def order(self) -> tuple[float, int]:
        return (self.tag.start, self.seq)


class Admission:
    def __init__(
        self,
        members: Membership,
        load: Load,
        policy: PolicyName,
        max_inflight: int,
        max_queue: int,
        max_per_tenant: int = 0,
        weights: Mapping[str, int] | None = None,
        home_slack: float = HOME_SLACK,
    ) -> None:
        self.members = members
        self.load = load
        self.max_inflight = max_inflight
        self.max_queue = max_queue
        self.max_per_tenant = max_per_tenant  # 0: no cap
        self._policy = make_policy(policy, home_slack)
        self._tickets = 0
        self._clock = FairClock(dict(weights or {}))
        self._waiters: list[_Waiter] = []  # in fair order
        self._arrivals = 0
        self._held: dict[str, int] = {}  # a tenant's requests in flight or waiting here
        self._homes = AdapterHomes()  # where adapter sets live, by the demand seen here

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
            own = self.load.estimate(replica, params)[1]
            return Estimate(outstanding, own, self.load.miss_cost_s(replica, params))

        return there

    def _serving(self) -> list[str]:
        return [r.endpoint for r in self.members.serving()]

    def _home(self, affinity: str | None) -> str | None:
        """The adapters' home by the demand seen here (adapter_homes.py); None without
        adapters, or until every serving replica's cache size is known."""
        if affinity is None:
            return None
        slots: dict[str, int] = {}
        for replica in self.members.serving():
            held = cache_slots(replica.adapters)
            if held is None:
                return None
            slots[replica.endpoint] = held
        return self._homes.home(affinity, slots)

    def _pick(self, avoid: set[str], params: p.GenerateParams) -> Replica | None:
        replicas = self.members.replicas
        there, affinity = self._there(params), self.load.affinity(params)
        home = self._home(affinity)
        # **Decision** (docs/lora.md): a replica that holds the request's adapters, or
        # is their home, may take it past its cap, up to HOLDER_CAP_FACTOR times, when
        # least work picks it. At the cap alone, a holder with one request queued is
        # never a choice, and the adapter loads on the other replica, evicting one
        # that is in demand there. Not while requests wait here: they go first.
        stretch = affinity is not None and not self._waiters

        def free(endpoint: str, allow_avoided: bool) -> bool:
            r = replicas[endpoint]
            cap = self.cap(r)
            if stretch and r.inflight >= cap and (endpoint == home or there(endpoint).load_s == 0):
                cap *= HOLDER_CAP_FACTOR
            ok = r.serving and r.inflight < cap
            return ok and (allow_avoided or endpoint not in avoid)

        key = self._policy.pick(replicas, lambda e: free(e, False), there, affinity, home)
        # A retry prefers another replica, but takes the same one if it is the only one.
        if key is None and avoid and not any(e not in avoid for e in self._serving()):
            key = self._policy.pick(replicas, lambda e: free(e, True), there, affinity, home)
        return replicas[key] if key is not None else None

    def _seen(self, params: p.GenerateParams) -> None:
        """Counts a new request's adapters into the demand homes are placed by."""
        affinity = self.load.affinity(params)
        if affinity is not None:
            self._homes.demand.seen(affinity)

    def held(self, tenant: str) -> int:
        """``tenant``'s requests in flight or waiting at this router (video jobs aside)."""
        return self._held.get(tenant, 0)

    async def acquire(
        self,
        avoid: set[str],
        timeout_s: float,
        params: p.GenerateParams,
        tenant: str = KEYLESS.tenant,
    ) -> Slot:
        """A slot on a serving replica for ``tenant``'s ``params``, waiting its fair turn;
        429 past the tenant's cap or when the queue is full and the tenant holds its
        share of it. ``avoid`` non-empty: a retry, which the cap does not refuse."""
        if not avoid:
            self._check_cap(tenant)
            self._seen(params)
        if self._waiters:
            self.wake()  # capacity no waiter has seen (a ping raised a batch size) is theirs
        replica = self._pick(avoid, params)
        if replica is not None:
            self._clock.started(self._clock.arrive(tenant, self._units(params)))
            self._count(tenant, 1)
            return self.take(replica, params, tenant)
        waiter = self._enqueue(tenant, avoid, params)
        try:
            return await wait_within(waiter.future, timeout_s)
        except TimeoutError:
            raise p.RequestError(
                p.UNAVAILABLE, f"no replica could take the request within {timeout_s:.0f}s"
            ) from None
        except asyncio.CancelledError:
            # Handed a slot in the same turn as the cancel: it goes back at once.
            future = waiter.future
            if future.done() and not future.cancelled() and future.exception() is None:
                self.release(future.result())
            raise
        finally:
            if waiter in self._waiters:  # timed out or cancelled while waiting
                self._drop(waiter)

    def _check_cap(self, tenant: str) -> None:
        held = self.held(tenant)
        if self.max_per_tenant and held >= self.max_per_tenant:
            raise p.RequestError(
                p.OVERLOADED,
                f"tenant {tenant!r} has {held} requests in flight or waiting at this router, "
                f"its cap (--max-requests-per-tenant {self.max_per_tenant}; CRD "
                "spec.router.maxRequestsPerTenant): retry when one of them is answered",
            )

    def _enqueue(self, tenant: str, avoid: set[str], params: p.GenerateParams) -> _Waiter:
        if len(self._waiters) >= self.max_queue:
            waiting: dict[str, int] = {}
            for w in self._waiters:
                waiting[w.tenant] = waiting.get(w.tenant, 0) + 1
            victim = over_share(waiting, self._clock.weights, tenant)
            if victim is None:
                mine = waiting.get(tenant, 0)
                raise p.RequestError(
                    p.OVERLOADED,
                    f"all replicas are busy and {len(self._waiters)} requests wait "
                    f"(--max-waiting {self.max_queue}, shared fairly between tenants; "
                    f"{mine} of them are this tenant's)",
                )
            self._evict(victim)
        self._arrivals += 1
        tag = self._clock.arrive(tenant, self._units(params))
        future: asyncio.Future[Slot] = asyncio.get_running_loop().create_future()
        waiter = _Waiter(tenant, tag, self._arrivals, avoid, params, future)
        bisect.insort(self._waiters, waiter, key=lambda w: w.order)
        self._count(tenant, 1)
        return waiter

    def _evict(self, tenant: str) -> None:
        """The queue is full: ``tenant``'s newest waiter makes room for a fairer one."""
        newest = max((w for w in self._waiters if w.tenant == tenant), key=lambda w: w.order)
        self._drop(newest)
        newest.future.set_exception(
            p.RequestError(
                p.OVERLOADED,
                f"all replicas are busy and the queue (--max-waiting {self.max_queue}) is full; "
                f"tenant {tenant!r} held more than its share of it, so its newest request "
                "gave way to another tenant's",
            )
        )

    def _drop(self, waiter: _Waiter) -> None:
        """A waiter leaves without a slot: its place, its count and its charge go."""
        self._waiters.remove(waiter)
        self._count(waiter.tenant, -1)
        self._clock.refund(waiter.tenant, waiter.tag)

    def _count(self, tenant: str, change: int) -> None:
        held = self._held.get(tenant, 0) + change
        if held > 0:
            self._held[tenant] = held
        else:
            self._held.pop(tenant, None)

    def _units(self, params: p.GenerateParams) -> float:
        """The request's cost units for the fair order (any replica's defaults do)."""
        replicas = self.members.serving() or self.members.members()
        return self.load.estimate(replicas[0], params)[0] if replicas else 1.0

    def _room(self) -> bool:
        return any(r.inflight < self.cap(r) for r in self.members.serving())

    def place(self, avoid: set[str], params: p.GenerateParams) -> Slot:
        """A slot for a video job (dpserve/router/videos.py): the policy's pick among
        serving replicas, at once, past the in-flight cap. A job API answers at once and
        the job queues at its replica, whose --max-queue bounds it; its slot puts its
        work in the replica's ledger, so image requests and the autoscaling gauges see
        it. Another replica than ``avoid`` when one serves; 503 when none does."""
        replicas = self.members.replicas
        there, affinity = self._there(params), self.load.affinity(params)
        if not avoid:
            self._seen(params)
        home = self._home(affinity)
        serving = set(self._serving())
        fresh = serving - avoid
        key = self._policy.pick(replicas, lambda e: e in fresh, there, affinity, home)
        if key is None:
            key = self._policy.pick(replicas, lambda e: e in serving, there, affinity, home)
        if key is None:
            raise p.RequestError(p.UNAVAILABLE, "no replica is serving yet; retry shortly")
        return self.take(replicas[key], params)

    def take(self, replica: Replica, params: p.GenerateParams, tenant: str | None = None) -> Slot:
        """A slot on ``replica``, whatever its load (the callers chose it); ``tenant``:
        whose count it is in until released (None: nobody's, a video job's)."""
        replica.inflight += 1
        units, seconds = self.load.estimate(replica, params)
        # Its adapters' load is work there too (once: the eviction's reload that
        # placement weighs is a later request's); then they count as on their way.
        seconds += self.load.adapter_load_s(replica, params)
        adapters = names_of(params.lora)
        replica.trail.sent(adapters)
        self._tickets += 1
        replica.ledger.add(self._tickets, units, seconds, time.monotonic())
        return Slot(replica, self._tickets, units, seconds, tenant, adapters)

    def release(self, slot: Slot) -> None:
        """The slot's request was answered (or failed): its work leaves the replica."""
        slot.replica.inflight -= 1
        now = time.monotonic()
        slot.replica.ledger.remove(slot.ticket, now)
        slot.replica.trail.answered(slot.adapters, now)
        if slot.tenant is not None:
            self._count(slot.tenant, -1)
        self.wake()

    def note_served(self, replica: Replica) -> None:
        replica.served += 1

    def wake(self) -> None:
        """Capacity may have freed (a slot released, a replica joined rotation): waiters
        take free slots in fair order. One whose pick finds none (it avoids the replica
        with room) waits on, and those behind it may go."""
        for waiter in list(self._waiters):
            if not self._room():
                break
            replica = self._pick(waiter.avoid, waiter.params)
            if replica is None:
                continue
            self._waiters.remove(waiter)
            self._clock.started(waiter.tag)
            waiter.future.set_result(self.take(replica, waiter.params, waiter.tenant))

    # ------------------------------------------------------------ realtime sessions

    def session_opened(self, replica: Replica) -> None:
        replica.sessions += 1

    def session_closed(self, replica: Replica) -> None:
        replica.sessions = max(0, replica.sessions - 1)

    def session_refused(self, replica: Replica) -> None:
        replica.sessions = max(replica.sessions, replica.max_sessions)  # until its next ping
