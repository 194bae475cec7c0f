"""The replicas behind a router: health, admission, and keeping them in sync.

A replica serves only when it answers pings, reports ``ok``, and has applied
every entry of the control log. Generation requests take a slot on a serving
replica (round-robin, at most ``max_inflight`` each) or wait in a bounded FIFO.
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
from dpserve.router.connection import ReplicaConnection, ReplicaLost
from dpserve.router.control_log import ControlLog
from dpserve.router.policies import RoundRobin

log = logging.getLogger(__name__)


@dataclass
class PoolSettings:
    request_timeout_s: float = 300.0
    ping_interval_s: float = 1.0
    ping_timeout_s: float = 2.0
    control_timeout_s: float = 300.0
    max_inflight: int = 2  # per replica: one running, one queued keeps a gang busy
    max_queue: int = 256  # requests waiting for a slot, router-wide


@dataclass
class Replica:
    endpoint: str
    conn: ReplicaConnection
    replica_id: str = ""  # the worker's replica index, as it reports it
    boot_id: str = ""
    answering: bool = False
    serving: bool = False
    status: str = "unknown"
    applied: int = 0  # control-log positions the replica reports applied since it booted
    inflight: int = 0
    served: int = 0
    last_error: str | None = None
    last_seen: float = 0.0
    info: dict[str, Any] | None = None
    sessions: int = 0  # realtime sessions it holds, as of its last ping
    max_sessions: int = 0
    session_bytes: int = 0

    @property
    def full(self) -> bool:
        return 0 < self.max_sessions <= self.sessions

    @property
    def name(self) -> str:
        return self.replica_id or self.endpoint

    def snapshot(self) -> dict[str, Any]:
        return {
            "replica": self.name,
            "endpoint": self.endpoint,
            "state": "serving" if self.serving else ("syncing" if self.answering else "down"),
            "status": self.status,
            "in_flight": self.inflight,
            "served": self.served,
            "applied_control_ops": self.applied,
            "sessions": self.sessions,
            "max_sessions": self.max_sessions,
            "session_bytes": self.session_bytes,
            "last_error": self.last_error,
            "last_seen_s_ago": round(time.monotonic() - self.last_seen, 3)
            if self.last_seen
            else None,
        }


@dataclass
class ReplicaPool:
    settings: PoolSettings
    ctx: zmq.asyncio.Context = field(default_factory=zmq.asyncio.Context)
    log: ControlLog = field(default_factory=ControlLog)
    replicas: dict[str, Replica] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._rr = RoundRobin()
        self._leaving: dict[str, tuple[Replica, asyncio.Task[None]]] = {}
        self._waiters: deque[asyncio.Future[None]] = deque()
        # Serializes control fan-outs with catch-up replays, so log order is apply order.
        self.control_lock = asyncio.Lock()
        self._health: asyncio.Task[None] | None = None

    # ------------------------------------------------------------ membership

    async def set_endpoints(self, endpoints: Iterable[str]) -> None:
        """Discovery's view of the world: connect new replicas, drop vanished ones."""
        wanted = set(endpoints)
        for endpoint in wanted - set(self.replicas):
            leaving = self._leaving.pop(endpoint, None)
            if leaving is not None:  # back before it finished draining: keep it
                self.replicas[endpoint] = leaving[0]
                continue
            self.replicas[endpoint] = Replica(endpoint, ReplicaConnection(self.ctx, endpoint))
            log.info("replica %s added", endpoint)
        for endpoint in set(self.replicas) - wanted:
            replica = self.replicas.pop(endpoint)
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

    async def start(self) -> None:
        await self.check_all()
        self._health = asyncio.create_task(self._health_loop(), name="health")

    async def close(self) -> None:
        if self._health is not None:
            self._health.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health
        for _, task in list(self._leaving.values()):
            task.cancel()  # its cleanup closes the connection
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for replica in self.replicas.values():
            await replica.conn.close()
        self.replicas.clear()
        self.ctx.term()

    # ------------------------------------------------------------ health

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.ping_interval_s)
            try:
                await self.check_all()
            except Exception:  # one bad round must not end health checking
                log.exception("health round failed")

    async def check_all(self) -> None:
        try:
            await self.log.refresh()  # other routers may have appended
        except Exception as exc:  # keep serving on the log we have
            log.warning("control log refresh failed: %s", exc)
        await asyncio.gather(*(self._check(r) for r in list(self.replicas.values())))
        self._wake()

    async def _check(self, replica: Replica) -> None:
        try:
            reply = await replica.conn.request(p.PING, None, self.settings.ping_timeout_s)
            ping: p.PingResult = reply.body_as(p.PingResult)
        except (ReplicaLost, TimeoutError, p.RequestError, p.ProtocolError) as exc:
            self._down(replica, f"ping failed: {exc or type(exc).__name__}")
            return
        replica.answering, replica.last_seen, replica.status = True, time.monotonic(), ping.status
        replica.replica_id, replica.applied = str(ping.replica), ping.applied
        replica.sessions, replica.max_sessions = ping.sessions, ping.max_sessions
        replica.session_bytes = ping.session_bytes
        if ping.boot_id != replica.boot_id:
            if replica.boot_id:
                log.warning("replica %s restarted: it will be replayed the log", replica.name)
            replica.boot_id, replica.info = ping.boot_id, None
        if ping.status != "ok":
            replica.serving = False
            replica.last_error = f"replica reports {ping.status}"
            return
        if self.log.since(replica.applied) and not await self._catch_up(replica):
            return
        if replica.info is None:
            replica.info = await self._model_info(replica)
        if replica.info is not None and not replica.serving:
            log.info("replica %s serving (%s)", replica.name, replica.endpoint)
            replica.serving, replica.last_error = True, None

    def _down(self, replica: Replica, reason: str) -> None:
        if replica.serving:
            log.warning("replica %s out of rotation: %s", replica.name, reason)
        replica.answering = replica.serving = False
        replica.last_error = reason

    def mark_failed(self, replica: Replica, reason: str) -> None:
        """A request saw the replica fail: stop sending to it until pings say otherwise."""
        self._down(replica, reason)

    async def _catch_up(self, replica: Replica) -> bool:
        async with self.control_lock:
            return await self.replay(replica)

    async def replay(self, replica: Replica) -> bool:
        """Send what the replica missed, in order; True when it is caught up.

        The caller holds ``control_lock``.
        """
        for position, op, args in self.log.since(replica.applied):
            request = p.ControlRequest(op=op, args=args, log_position=position)
            try:
                await replica.conn.request(p.CONTROL, request, self.settings.control_timeout_s)
            except (ReplicaLost, TimeoutError, p.RequestError) as exc:
                replica.serving = False
                replica.last_error = f"replaying {op} (log position {position}) failed: {exc}"
                log.warning("replica %s: %s", replica.name, replica.last_error)
                return False
            replica.applied = position

        return not self.log.since(replica.applied)

    async def _model_info(self, replica: Replica) -> dict[str, Any] | None:
        request = p.ControlRequest(op="model_info")
        try:
            reply = await replica.conn.request(p.CONTROL, request, self.settings.ping_timeout_s)
        except (ReplicaLost, TimeoutError, p.RequestError) as exc:
            replica.last_error = f"model_info failed: {exc}"
            return None
        result: p.ControlResult = reply.body_as(p.ControlResult)
        return result.result

    # ------------------------------------------------------------ admission

    def serving(self) -> list[Replica]:
        return [r for r in self.replicas.values() if r.serving]

    @property
    def queue_depth(self) -> int:
        return len(self._waiters)

    def _pick(self, avoid: set[str]) -> Replica | None:
        def free(endpoint: str, allow_avoided: bool) -> bool:
            r = self.replicas[endpoint]
            ok = r.serving and r.inflight < self.settings.max_inflight
            return ok and (allow_avoided or endpoint not in avoid)

        key = self._rr.pick(self.replicas, lambda e: free(e, False))
        # A retry prefers another replica, but takes the same one if it is the only one.
        if key is None and avoid and not any(r.endpoint not in avoid for r in self.serving()):
            key = self._rr.pick(self.replicas, lambda e: free(e, True))
        return self.replicas[key] if key is not None else None

    async def acquire(self, avoid: set[str], timeout_s: float) -> Replica:
        """A slot on a serving replica, waiting in FIFO order; 429 when the queue is full."""
        deadline = time.monotonic() + timeout_s
        while True:
            replica = self._pick(avoid)
            if replica is not None:
                replica.inflight += 1
                return replica
            if len(self._waiters) >= self.settings.max_queue:
                raise p.RequestError(
                    p.OVERLOADED, f"all replicas are busy and {len(self._waiters)} requests wait"
                )
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await asyncio.wait_for(waiter, max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise p.RequestError(
                    p.UNAVAILABLE, f"no replica could take the request within {timeout_s:.0f}s"
                ) from None
            finally:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)

    def release(self, replica: Replica) -> None:
        replica.inflight -= 1
        self._wake()

    def _wake(self) -> None:
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)
