"""Whether each replica answers, and what it reports: the router's health pings.

:class:`Health` runs one ping loop per replica (one slow or stopped replica never
delays another's pings) and writes what a ping reports into the replica's record:
its id and boot, status, the control state it holds, its sessions, load and cost
calibration, and the model's description (asked once per boot). A replica whose
ping fails outright leaves rotation; one that misses ``abandon_after`` pings in a
row leaves it too, and what it holds is failed then, so callers retry elsewhere.

What a ping means for rotation is the control plane's to judge: each answered ping
hands the document the replica holds to ``adopt`` (a newer one becomes the desired
state) and the replica to ``settle`` (dpserve/router/control_plane.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable

from dpserve.contract import protocol as p
from dpserve.contract.control_state import StateDoc, parse_doc
from dpserve.contract.model_info import ModelInfo, ModelInfoError
from dpserve.contract.model_info import decode as decode_model_info
from dpserve.router.connection import ReplicaLost
from dpserve.router.membership import Membership
from dpserve.router.replica import Replica

log = logging.getLogger(__name__)


class Health:
    def __init__(
        self,
        members: Membership,
        adopt: Callable[[StateDoc | None], None],
        settle: Callable[[Replica], None],
        interval_s: float,
        timeout_s: float,
        abandon_after: int,
    ) -> None:
        self.members = members
        self._adopt = adopt
        self._settle = settle
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.abandon_after = abandon_after
        self._loops: dict[str, asyncio.Task[None]] = {}

    def watch(self, replica: Replica) -> None:
        """Ping ``replica`` every interval from now on (once per endpoint)."""
        if replica.endpoint not in self._loops:
            task = asyncio.create_task(self._loop(replica), name=f"health {replica.name}")
            self._loops[replica.endpoint] = task

    def stop(self, endpoint: str) -> None:
        task = self._loops.pop(endpoint, None)
        if task is not None:
            task.cancel()

    def tasks(self) -> list[asyncio.Task[None]]:
        return list(self._loops.values())

    async def _loop(self, replica: Replica) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.check(replica)
            except Exception:  # one bad round must not end health checking
                log.exception("health check of %s failed", replica.name)

    async def recheck(self, replicas: Iterable[Replica]) -> None:
        """Ping these replicas now, not at their next turn: what they hold, adopted
        when it is newer (a control op met another router's state there)."""
        await asyncio.gather(*(self.check(r) for r in replicas))

    async def check(self, replica: Replica) -> None:
        """One ping of ``replica``, recorded, and judged by the control plane."""
        asked = time.monotonic()
        try:
            reply = await replica.conn.request(p.PING, None, self.timeout_s)
            ping: p.PingResult = reply.body_as(p.PingResult)
            held = parse_doc(ping.control) if ping.control is not None else None
        except TimeoutError:
            self._missed(replica, f"ping timed out after {self.timeout_s:g}s")
            return
        except (ReplicaLost, p.RequestError, p.ProtocolError, ValueError) as exc:
            replica.missed_pings += 1
            self.mark_failed(replica, f"ping failed: {str(exc) or type(exc).__name__}")
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
        replica.adapters = ping.adapters
        replica.trail.pinged(asked)
        # The replica counts every router's work, ours included (in flight now, give
        # or take what is on the wire): the rest is other routers'.
        replica.others_units = max(0.0, ping.outstanding_units - replica.ledger.units)
        if ping.boot_id != replica.boot_id:
            if replica.boot_id:
                log.warning(
                    "replica %s restarted: it is brought to the desired state", replica.name
                )
            replica.boot_id, replica.info = ping.boot_id, None
        self._adopt(held)  # another router's op (or a restarted router): follow it
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
        if replica.missed_pings == self.abandon_after or not replica.answering:
            self.mark_failed(replica, reason)
            # What it holds is answered elsewhere (the service retries it).
            replica.conn.abandon(f"{replica.endpoint} missed {replica.missed_pings} pings")

    def mark_failed(self, replica: Replica, reason: str) -> None:
        """The replica failed a ping or a request: stop sending to it until pings say
        otherwise."""
        if replica.serving:
            log.warning("replica %s out of rotation: %s", replica.name, reason)
        replica.answering = replica.serving = False
        replica.last_error = reason

    async def _model_info(self, replica: Replica) -> ModelInfo | None:
        request = p.ControlRequest(op="model_info")
        try:
            reply = await replica.conn.request(p.CONTROL, request, self.timeout_s)
            result: p.ControlResult = reply.body_as(p.ControlResult)
            info = decode_model_info(result.result)
        except ModelInfoError as exc:
            if replica.info_error != str(exc):  # once, not at every ping
                log.error("replica %s cannot serve: %s", replica.name, exc)
            replica.last_error = replica.info_error = str(exc)
            return None
        except (ReplicaLost, TimeoutError, p.RequestError) as exc:
            replica.last_error = f"model_info failed: {exc}"
            return None
        replica.info_error = None
        return info

    async def boot_id(self, replica: Replica) -> str | None:
        """The replica's boot id, asked now rather than at its next ping (which records
        it); None when it does not answer."""
        try:
            reply = await replica.conn.request(p.PING, None, self.timeout_s)
            ping: p.PingResult = reply.body_as(p.PingResult)
        except (ReplicaLost, TimeoutError, p.RequestError, p.ProtocolError):
            return None
        return ping.boot_id
