"""The replicas behind a router: health, admission, and bringing them to the desired state.

:class:`ReplicaPool` is the one owner of every :class:`Replica`'s fields; the
service, the session router and the HTTP routes read them and report events
through the pool's methods. Each replica has its own health task (one slow or
stopped replica never delays another's pings) and, while it does not hold the
desired control state, its own sync task. A replica serves only when it answers
pings, reports ``ok``, and holds the desired control state. Generation requests
take a slot on a serving replica (the routing policy picks: least estimated work,
or round-robin; at most ``max_inflight`` x the replica's batch size each) or wait
in a bounded FIFO; video jobs are placed at once, past the cap (:meth:`place`).
Each slot carries the request's estimated cost, so the pool knows every replica's
outstanding work (dpserve.cost, docs/router.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import zmq.asyncio

from dpserve import protocol as p
from dpserve.control_state import StateDoc, parse_doc
from dpserve.cost import cost_units
from dpserve.model_info import ModelInfo, ModelInfoError
from dpserve.model_info import decode as decode_model_info
from dpserve.router.connection import ReplicaConnection, ReplicaLost
from dpserve.router.desired import DesiredState, OutOfSync
from dpserve.router.policies import (
    Estimate,
    PolicyName,
    ReplicaOutcome,
    WorkLedger,
    make_policy,
    measured_seconds_per_unit,
    seconds_per_unit,
)
from dpserve.router.waiting import wait_within
from dpserve.wire import WireKey, plaintext_warning

log = logging.getLogger(__name__)


@dataclass
class PoolSettings:
    request_timeout_s: float = 300.0
    ping_interval_s: float = 1.0
    ping_timeout_s: float = 2.0
    # Pings are answered by the driver's ingress thread even mid-generation, so this
    # many missed in a row means a stopped or hung process: it leaves rotation and
    # its in-flight requests are failed then (and retried elsewhere), not at the
    # request timeout. Fewer is more likely the router's own lag.
    abandon_after_missed_pings: int = 2
    control_timeout_s: float = 300.0
    sync_backoff_max_s: float = 30.0
    # Per replica, times its batch size (--max-batch, from its pings): one running
    # batch and one queued keeps a gang busy.
    max_inflight: int = 2
    policy: PolicyName = "least_work"  # or "round_robin" (docs/router.md, Routing policies)
    max_queue: int = 256  # requests waiting for a slot, router-wide
    # The service's wire key: the router is a CURVE client of every driver with it.
    # None: plaintext (only for a wire nobody else can reach; warned at start).
    wire_key: WireKey | None = None


@dataclass
class Replica:
    endpoint: str
    conn: ReplicaConnection
    replica_id: str = ""  # the worker's replica index, as it reports it
    boot_id: str = ""
    answering: bool = False
    serving: bool = False  # derived by the pool from the fields below
    status: str = "unknown"
    held: StateDoc | None = None  # the control state it reports
    sync_error: str | None = None  # why it could not reach the desired state
    missed_pings: int = 0
    inflight: int = 0
    served: int = 0
    last_error: str | None = None
    last_seen: float = 0.0
    info: ModelInfo | None = None
    sessions: int = 0  # realtime sessions it holds, as of its last ping
    max_sessions: int = 0
    session_bytes: int = 0
    # Load, as of its last ping, and this router's own work there (the cost model).
    max_batch: int = 1
    cost: p.CostReport = field(default_factory=p.CostReport)
    queue_depth: int = 0  # requests queued at the replica (every router's)
    busy_fraction: float = 0.0
    others_units: float = 0.0  # units there that are not this router's
    ledger: WorkLedger = field(default_factory=WorkLedger)
    # One control conversation at a time, so a sync and a fan-out never interleave.
    control: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def full(self) -> bool:
        return 0 < self.max_sessions <= self.sessions

    @property
    def name(self) -> str:
        return self.replica_id or self.endpoint


@dataclass(frozen=True)
class Slot:
    """A generation's place on a replica, and its cost there, until :meth:`ReplicaPool.release`."""

    replica: Replica
    ticket: int
    units: float
    seconds: float


@dataclass
class ReplicaPool:
    settings: PoolSettings
    ctx: zmq.asyncio.Context = field(default_factory=zmq.asyncio.Context)
    desired: DesiredState = field(default_factory=DesiredState)
    replicas: dict[str, Replica] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._policy = make_policy(self.settings.policy)
        self._tickets = 0
        self._leaving: dict[str, tuple[Replica, asyncio.Task[None]]] = {}
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._health: dict[str, asyncio.Task[None]] = {}
        self._syncs: dict[str, asyncio.Task[None]] = {}
        self._state_task: asyncio.Task[None] | None = None
        self._started = False

    # ------------------------------------------------------------ membership

    async def set_endpoints(self, endpoints: Iterable[str]) -> None:
        """Discovery's view of the world: connect new replicas, drop vanished ones."""
        wanted = set(endpoints)
        for endpoint in wanted - set(self.replicas):
            leaving = self._leaving.pop(endpoint, None)
            if leaving is not None:  # back before it finished draining: keep it
                self.replicas[endpoint] = leaving[0]
            else:
                conn = ReplicaConnection(self.ctx, endpoint, self.settings.wire_key)
                self.replicas[endpoint] = Replica(endpoint, conn)
                log.info("replica %s added", endpoint)
            if self._started:
                self._watch(self.replicas[endpoint])
        for endpoint in set(self.replicas) - wanted:
            replica = self.replicas.pop(endpoint)
            self._stop_tasks(endpoint)
            replica.serving = replica.answering = False
            # A removed replica is usually draining (scale-down, rollout): it gets no
            # new work, but what it is running still gets its answer.
            task = asyncio.create_task(self._drain(replica), name=f"drain {endpoint}")
            self._leaving[endpoint] = (replica, task)
            log.info("replica %s removed; draining %d in flight", endpoint, replica.inflight)
        self._wake()

    async def _drain(self, replica: Replica) -> None:
        deadline = time.monotonic() + self.settings.request_timeout_s
        back = False
        try:
            while replica.conn.in_flight and time.monotonic() < deadline:
                if self.replicas.get(replica.endpoint) is replica:
                    back = True  # re-added by discovery: it stays connected
                    return
                await asyncio.sleep(0.1)
            back = self.replicas.get(replica.endpoint) is replica
        finally:
            if not back:
                self._leaving.pop(replica.endpoint, None)
                await replica.conn.close()

    def members(self) -> list[Replica]:
        return list(self.replicas.values())

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Read the stored state and ask every replica once before anything serves, so
        the desired state is the newest anyone holds, not whichever replica answered first."""
        if self.settings.wire_key is None:
            plaintext_warning(
                "the router", "prompts and images cross the network in plaintext, unauthenticated"
            )
        with contextlib.suppress(Exception):  # an unreachable store: the replicas tell us
            await self.desired.refresh()
        await self.check_all()
        self._started = True
        for replica in self.members():
            self._watch(replica)
        self._state_task = asyncio.create_task(self._state_loop(), name="control state")

    async def close(self) -> None:
        tasks = [*self._health.values(), *self._syncs.values()]
        tasks += [t for _, t in self._leaving.values()]  # their cleanup closes connections
        if self._state_task is not None:
            tasks.append(self._state_task)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for replica in self.replicas.values():
            await replica.conn.close()
        self.replicas.clear()
        self.ctx.term()

    def _watch(self, replica: Replica) -> None:
        if replica.endpoint not in self._health:
            task = asyncio.create_task(self._health_loop(replica), name=f"health {replica.name}")
            self._health[replica.endpoint] = task

    def _stop_tasks(self, endpoint: str) -> None:
        for tasks in (self._health, self._syncs):
            task = tasks.pop(endpoint, None)
            if task is not None:
                task.cancel()

    # ------------------------------------------------------------ health

    async def _health_loop(self, replica: Replica) -> None:
        while True:
            await asyncio.sleep(self.settings.ping_interval_s)
            try:
                await self._check(replica)
            except Exception:  # one bad round must not end health checking
                log.exception("health check of %s failed", replica.name)

    async def check_all(self) -> None:
        await self.recheck(self.members())

    async def recheck(self, replicas: Iterable[Replica]) -> None:
        """Ping these replicas now, not at their next turn: what they hold, adopted
        when it is newer (a control op met another router's state there)."""
        await asyncio.gather(*(self._check(r) for r in replicas))

    async def _check(self, replica: Replica) -> None:
        try:
            reply = await replica.conn.request(p.PING, None, self.settings.ping_timeout_s)
            ping: p.PingResult = reply.body_as(p.PingResult)
            held = parse_doc(ping.control) if ping.control is not None else None
        except TimeoutError:
            self._missed(replica, f"ping timed out after {self.settings.ping_timeout_s:g}s")
            return
        except (ReplicaLost, p.RequestError, p.ProtocolError, ValueError) as exc:
            replica.missed_pings += 1
            self._down(replica, f"ping failed: {str(exc) or type(exc).__name__}")
            return
        replica.answering, replica.last_seen, replica.status = True, time.monotonic(), ping.status
        replica.missed_pings = 0
        replica.replica_id, replica.held = str(ping.replica), held
        replica.sessions, replica.max_sessions = ping.sessions, ping.max_sessions
        replica.session_bytes = ping.session_bytes
        replica.max_batch, replica.queue_depth = max(1, ping.max_batch), ping.queue_depth
        replica.busy_fraction = ping.busy_fraction
        if ping.cost is not None:
            replica.cost = ping.cost
        # The replica counts every router's work, ours included (in flight now, give
        # or take what is on the wire): the rest is other routers'.
        replica.others_units = max(0.0, ping.outstanding_units - replica.ledger.units)
        if ping.boot_id != replica.boot_id:
            if replica.boot_id:
                log.warning(
                    "replica %s restarted: it is brought to the desired state", replica.name
                )
            replica.boot_id, replica.info = ping.boot_id, None
        if self.desired.observe(held):
            self._settle_all()  # another router's op (or a restarted router): follow it
        if ping.status != "ok":
            replica.last_error = f"replica reports {ping.status}"
        elif replica.info is None:
            replica.info = await self._model_info(replica)
        self._settle(replica)

    def _missed(self, replica: Replica, reason: str) -> None:
        """One missed ping is as likely this router's own lag (a busy event loop) as the
        replica's; missing several in a row means a stopped or hung driver."""
        replica.missed_pings += 1
        replica.last_error = reason
        if (
            replica.missed_pings == self.settings.abandon_after_missed_pings
            or not replica.answering
        ):
            self._down(replica, reason)
            # What it holds is answered elsewhere (the service retries it).
            replica.conn.abandon(f"{replica.endpoint} missed {replica.missed_pings} pings")

    def _down(self, replica: Replica, reason: str) -> None:
        if replica.serving:
            log.warning("replica %s out of rotation: %s", replica.name, reason)
        replica.answering = replica.serving = False
        replica.last_error = reason

    def mark_failed(self, replica: Replica, reason: str) -> None:
        """A request saw the replica fail: stop sending to it until pings say otherwise."""
        self._down(replica, reason)

    async def _model_info(self, replica: Replica) -> ModelInfo | None:
        request = p.ControlRequest(op="model_info")
        try:
            reply = await replica.conn.request(p.CONTROL, request, self.settings.ping_timeout_s)
            result: p.ControlResult = reply.body_as(p.ControlResult)
            return decode_model_info(result.result)
        except ModelInfoError as exc:
            if replica.last_error != str(exc):  # once, not at every ping
                log.error("replica %s cannot serve: %s", replica.name, exc)
            replica.last_error = str(exc)
            return None
        except (ReplicaLost, TimeoutError, p.RequestError) as exc:
            replica.last_error = f"model_info failed: {exc}"
            return None

    # ------------------------------------------------------------ the desired state

    def _settle(self, replica: Replica) -> None:
        """Derive whether the replica serves; start its sync when it needs one."""
        if replica.endpoint not in self.replicas:
            return
        state = replica.held.state if replica.held is not None else None
        accepted = self.desired.accepts(state)
        if accepted:
            replica.sync_error = None
        elif replica.answering and replica.status == "ok":
            self._start_sync(replica)
        serving = replica.answering and replica.status == "ok" and accepted
        serving = serving and replica.info is not None
        if serving and not replica.serving:
            log.info("replica %s serving (%s)", replica.name, replica.endpoint)
            replica.last_error = None
        elif replica.serving and not serving:
            log.warning("replica %s out of rotation: %s", replica.name, self._why_not(replica))
        replica.serving = serving
        self._wake()

    def _settle_all(self) -> None:
        for replica in self.members():
            self._settle(replica)

    def _why_not(self, replica: Replica) -> str:
        doc = self.desired.doc
        if not replica.answering or replica.status != "ok":
            return replica.last_error or replica.status
        if replica.sync_error:
            return replica.sync_error
        if doc is not None and not self.desired.accepts(
            replica.held.state if replica.held else None
        ):
            return f"catching up to control state version {doc.version}"
        return "starting"

    def _start_sync(self, replica: Replica) -> None:
        if self.desired.before is not None:
            return  # a fan-out is bringing every replica along
        task = self._syncs.get(replica.endpoint)
        if task is None or task.done():
            self._syncs[replica.endpoint] = asyncio.create_task(
                self._sync(replica), name=f"sync {replica.name}"
            )

    async def _sync(self, replica: Replica) -> None:
        """Bring one replica to the desired state, retrying with backoff while it fails."""
        backoff = 1.0
        while replica.answering and self.replicas.get(replica.endpoint) is replica:
            doc = self.desired.doc
            if doc is None or self.desired.before is not None:
                return
            if replica.held is not None and replica.held.state == doc.state:
                break
            outcome = await self.apply(replica, doc, p.SYNC_STATE, {})
            if outcome.error is None:
                break
            await asyncio.sleep(backoff)
            backoff = min(2 * backoff, self.settings.sync_backoff_max_s)
        self._settle(replica)

    async def ask(self, replica: Replica, request: p.ControlRequest) -> ReplicaOutcome:
        """One control op on one replica, as its part of a fan-out; a replica lost on the
        way leaves rotation."""
        if not replica.answering:
            return ReplicaOutcome(replica.name, skipped=f"down: {replica.last_error}")
        try:
            reply = await replica.conn.request(p.CONTROL, request, self.settings.control_timeout_s)
            body: p.ControlResult = reply.body_as(p.ControlResult)
        except p.RequestError as exc:
            return ReplicaOutcome(replica.name, error=exc.body())
        except (ReplicaLost, TimeoutError) as exc:
            self.mark_failed(replica, f"control op failed: {str(exc) or 'timed out'}")
            error = p.ErrorBody(code=p.UNAVAILABLE, message=str(exc) or "timed out")
            return ReplicaOutcome(replica.name, error=error)
        except p.ProtocolError as exc:
            return ReplicaOutcome(
                replica.name, error=p.ErrorBody(code=p.INTERNAL, message=str(exc))
            )
        return ReplicaOutcome(replica.name, result=body.result)

    async def apply(
        self, replica: Replica, doc: StateDoc, op: str, args: dict[str, Any]
    ) -> ReplicaOutcome:
        """Send ``doc`` (made by ``op``) to one replica; record what it holds after."""
        request = p.ControlRequest(op=op, args=args, state=doc.to_builtins())
        async with replica.control:
            outcome = await self.ask(replica, request)
        if outcome.result is not None:
            try:
                replica.held = parse_doc(outcome.result["state"])
            except (KeyError, ValueError) as exc:
                error = p.ErrorBody(code=p.INTERNAL, message=f"unreadable control answer: {exc}")
                outcome = ReplicaOutcome(replica.name, error=error)
        if outcome.error is not None:
            reason = f"cannot reach control state version {doc.version}: {outcome.error.message}"
            replica.sync_error = reason
        elif outcome.skipped is None:
            replica.sync_error = None
        return outcome

    def state_changed(self) -> None:
        """The desired state moved (an op finished): every replica is judged again."""
        self._settle_all()

    def out_of_sync(self) -> OutOfSync:
        """Replicas that tried and failed to reach the desired state (not ones still
        catching up: that is a few seconds of normal start-up), with the reason."""
        return {
            r.endpoint: r.sync_error
            for r in self.members()
            if r.answering and r.sync_error and not r.serving
        }

    async def _state_loop(self) -> None:
        """Follow the stored state (other routers' ops) and publish who is out of sync."""
        while True:
            await asyncio.sleep(self.settings.ping_interval_s)
            try:
                before = self.desired.doc
                await self.desired.refresh()
                if self.desired.doc is not before:
                    self._settle_all()
                await self.desired.report(self.out_of_sync(), set(self.replicas))
            except Exception as exc:  # keep serving on the state we have
                log.warning("control state store: %s", exc)

    # ------------------------------------------------------------ realtime sessions

    def session_opened(self, replica: Replica) -> None:
        replica.sessions += 1

    def session_closed(self, replica: Replica) -> None:
        replica.sessions = max(0, replica.sessions - 1)

    def session_refused(self, replica: Replica) -> None:
        replica.sessions = max(replica.sessions, replica.max_sessions)  # until its next ping

    # ------------------------------------------------------------ admission

    def serving(self) -> list[Replica]:
        return [r for r in self.replicas.values() if r.serving]

    @property
    def queue_depth(self) -> int:
        return len(self._waiters)

    def cap(self, replica: Replica) -> int:
        return self.settings.max_inflight * replica.max_batch

    def seconds_per_unit(self, replica: Replica) -> float:
        others = (r.cost.seconds_per_unit for r in self.members() if r is not replica)
        return seconds_per_unit(replica.cost.seconds_per_unit, others)

    def measured_seconds(self, replica: Replica, params: p.GenerateParams) -> float | None:
        """The request's estimated seconds on ``replica`` from measured seconds per unit
        (its own, else the others'); None while no replica has measured any."""
        others = (r.cost.seconds_per_unit for r in self.members() if r is not replica)
        spu = measured_seconds_per_unit(replica.cost.seconds_per_unit, others)
        return None if spu is None else cost_units(params, replica.cost) * spu

    def estimate(self, replica: Replica, params: p.GenerateParams) -> tuple[float, float]:
        """The request's cost units and estimated seconds on ``replica``."""
        units = cost_units(params, replica.cost)
        return units, units * self.seconds_per_unit(replica)

    def outstanding_s(self, replica: Replica, now: float | None = None) -> float:
        """Estimated seconds of work queued and running there: this router's (the
        running one shrinking as it runs) and other routers' (as of the last ping)."""
        now = time.monotonic() if now is None else now
        others = replica.others_units * self.seconds_per_unit(replica)
        return replica.ledger.seconds(now) + others

    def _pick(self, avoid: set[str], params: p.GenerateParams) -> Replica | None:
        def free(endpoint: str, allow_avoided: bool) -> bool:
            r = self.replicas[endpoint]
            ok = r.serving and r.inflight < self.cap(r)
            return ok and (allow_avoided or endpoint not in avoid)

        now = time.monotonic()

        def there(endpoint: str) -> Estimate:
            replica = self.replicas[endpoint]
            return Estimate(self.outstanding_s(replica, now), self.estimate(replica, params)[1])

        key = self._policy.pick(self.replicas, lambda e: free(e, False), there)
        # A retry prefers another replica, but takes the same one if it is the only one.
        if key is None and avoid and not any(r.endpoint not in avoid for r in self.serving()):
            key = self._policy.pick(self.replicas, lambda e: free(e, True), there)
        return self.replicas[key] if key is not None else None

    async def acquire(self, avoid: set[str], timeout_s: float, params: p.GenerateParams) -> Slot:
        """A slot on a serving replica for ``params``, waiting in FIFO order; 429 when
        the queue is full."""
        deadline = time.monotonic() + timeout_s
        while True:
            replica = self._pick(avoid, params)
            if replica is not None:
                return self.take(replica, params)
            if len(self._waiters) >= self.settings.max_queue:
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
        now = time.monotonic()

        def there(endpoint: str) -> Estimate:
            replica = self.replicas[endpoint]
            return Estimate(self.outstanding_s(replica, now), self.estimate(replica, params)[1])

        serving = {r.endpoint for r in self.serving()}
        fresh = serving - avoid
        key = self._policy.pick(self.replicas, lambda e: e in fresh, there)
        if key is None:
            key = self._policy.pick(self.replicas, lambda e: e in serving, there)
        if key is None:
            raise p.RequestError(p.UNAVAILABLE, "no replica is serving yet; retry shortly")
        return self.take(self.replicas[key], params)

    def take(self, replica: Replica, params: p.GenerateParams) -> Slot:
        """A slot on ``replica``, whatever its load (the callers chose it)."""
        replica.inflight += 1
        units, seconds = self.estimate(replica, params)
        self._tickets += 1
        replica.ledger.add(self._tickets, units, seconds, time.monotonic())
        return Slot(replica, self._tickets, units, seconds)

    def release(self, slot: Slot) -> None:
        """The slot's request was answered (or failed): its work leaves the replica."""
        slot.replica.inflight -= 1
        slot.replica.ledger.remove(slot.ticket, time.monotonic())
        self._wake()

    def note_served(self, replica: Replica) -> None:
        replica.served += 1

    def _wake(self) -> None:
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)

    # ------------------------------------------------------------ reporting

    def snapshot(self, replica: Replica) -> dict[str, Any]:
        if replica.serving:
            state = "serving"
        elif not replica.answering:
            state = "down"
        else:
            state = "out_of_sync" if replica.sync_error else "syncing"
        held = replica.held
        return {
            "replica": replica.name,
            "endpoint": replica.endpoint,
            "state": state,
            "status": replica.status,
            "in_flight": replica.inflight,
            "max_in_flight": self.cap(replica),
            "served": replica.served,
            "queue_depth": replica.queue_depth,
            "busy_fraction": replica.busy_fraction,
            "outstanding_work_s": round(self.outstanding_s(replica), 3),
            "outstanding_units": {
                "this_router": round(replica.ledger.units, 4),
                "other_routers": round(replica.others_units, 4),
            },
            "calibration": {
                "seconds_per_unit": replica.cost.seconds_per_unit,
                "samples": replica.cost.samples,
                "used_seconds_per_unit": self.seconds_per_unit(replica),
            },
            "control_state": {"version": held.version, "digest": held.state.digest()}
            if held
            else None,
            "sessions": replica.sessions,
            "max_sessions": replica.max_sessions,
            "session_bytes": replica.session_bytes,
            "last_error": None if replica.serving else self._why_not(replica),
            "last_seen_s_ago": round(time.monotonic() - replica.last_seen, 3)
            if replica.last_seen
            else None,
        }
