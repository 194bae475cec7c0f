"""Who is in the pool: discovery's endpoints as connected replicas, leaving ones drained.

:class:`Membership` owns the map of replicas and their connections: it makes and
closes them, and sends on them for code outside the pool's parts (generations and
their cancels, realtime sessions, video jobs: :meth:`request`, :meth:`cancel`,
:meth:`cancel_any`). A
replica discovery drops leaves rotation at once but keeps its connection until what
it runs has answered (a scale-down or a rollout drains), or until discovery brings
it back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import zmq.asyncio

from dpserve.contract import protocol as p
from dpserve.plumbing.curve import WireKey
from dpserve.router.connection import ReplicaConnection
from dpserve.router.replica import Replica

log = logging.getLogger(__name__)


class Membership:
    def __init__(self, ctx: zmq.asyncio.Context, wire_key: WireKey | None, drain_s: float) -> None:
        """``drain_s``: the longest a leaving replica keeps its connection for its answers."""
        self.ctx = ctx
        self.wire_key = wire_key
        self.drain_s = drain_s
        self.replicas: dict[str, Replica] = {}
        self._leaving: dict[str, tuple[Replica, asyncio.Task[None]]] = {}

    def members(self) -> list[Replica]:
        return list(self.replicas.values())

    def serving(self) -> list[Replica]:
        return [r for r in self.replicas.values() if r.serving]

    def holds(self, replica: Replica) -> bool:
        """Whether ``replica`` is still the member for its endpoint (not gone, not replaced)."""
        return self.replicas.get(replica.endpoint) is replica

    def update(self, endpoints: Iterable[str]) -> tuple[list[Replica], list[Replica]]:
        """Discovery's view of the world: connect new replicas, drain vanished ones;
        the replicas that joined and the ones that left."""
        wanted = set(endpoints)
        joined: list[Replica] = []
        for endpoint in wanted - set(self.replicas):
            leaving = self._leaving.pop(endpoint, None)
            if leaving is not None:  # back before it finished draining: keep it
                self.replicas[endpoint] = leaving[0]
            else:
                conn = ReplicaConnection(self.ctx, endpoint, self.wire_key)
                self.replicas[endpoint] = Replica(endpoint, conn)
                log.info("replica %s added", endpoint)
            joined.append(self.replicas[endpoint])
        left: list[Replica] = []
        for endpoint in set(self.replicas) - wanted:
            replica = self.replicas.pop(endpoint)
            replica.serving = replica.answering = False
            # A removed replica is usually draining (scale-down, rollout): it gets no
            # new work, but what it is running still gets its answer.
            task = asyncio.create_task(self._drain(replica), name=f"drain {endpoint}")
            self._leaving[endpoint] = (replica, task)
            log.info("replica %s removed; draining %d in flight", endpoint, replica.inflight)
            left.append(replica)
        return joined, left

    async def _drain(self, replica: Replica) -> None:
        deadline = time.monotonic() + self.drain_s
        back = False
        try:
            while replica.conn.in_flight and time.monotonic() < deadline:
                if self.holds(replica):
                    back = True  # re-added by discovery: it stays connected
                    return
                await asyncio.sleep(0.1)
            back = self.holds(replica)
        finally:
            if not back:
                self._leaving.pop(replica.endpoint, None)
                await replica.conn.close()

    async def request(
        self,
        replica: Replica,
        kind: str,
        body: Any,
        timeout_s: float,
        blobs: list[bytes] | None = None,
        *,
        request_id: str | None = None,
        deadline_s: float | None = None,
        on_partial: Callable[[p.Message], None] | None = None,
        tenant: str = "",
    ) -> p.Message:
        """One request to ``replica`` and its reply (raises what its connection raises);
        the keywords are :meth:`ReplicaConnection.request`'s."""
        return await replica.conn.request(
            kind,
            body,
            timeout_s,
            blobs,
            request_id=request_id,
            deadline_s=deadline_s,
            on_partial=on_partial,
            tenant=tenant,
        )

    def cancel(self, replica: Replica, request_id: str) -> None:
        """Tell ``replica`` nobody waits for ``request_id`` any more (never answered)."""
        replica.conn.cancel(request_id)

    async def cancel_any(
        self, replica: Replica, request_id: str, timeout_s: float, scope: str | None = None
    ) -> str:
        """Cancel ``request_id`` on ``replica`` whoever sent it, if it is ``scope``'s;
        where it was found (``p.CANCEL_*``)."""
        return (await replica.conn.cancel_any(request_id, timeout_s, scope)).found

    def tasks(self) -> list[asyncio.Task[None]]:
        """The drains under way (cancelling one closes its connection)."""
        return [task for _, task in self._leaving.values()]

    async def close(self) -> None:
        """Close every member's connection and the context (after :meth:`tasks` ended)."""
        for replica in self.replicas.values():
            await replica.conn.close()
        self.replicas.clear()
        self.ctx.term()
