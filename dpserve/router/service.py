"""The router's service layer: generation with one retry, control ops as a desired state."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from dpserve.contract import protocol as p
from dpserve.contract import validation as pv
from dpserve.router.coalesce import Coalescer, retrieve
from dpserve.router.connection import ReplicaLost
from dpserve.router.policies import FanoutAnswer, merge_fanout
from dpserve.router.pool import ReplicaPool
from dpserve.router.replica import Replica, Slot
from dpserve.router.tenants import KEYLESS

log = logging.getLogger(__name__)

# Replica-side refusals that say "this replica, not this request": try another one.
_RETRIABLE = frozenset({p.UNAVAILABLE, p.OVERLOADED})
# How long past the request's deadline the router still waits for the replica's own
# answer (its result, or deadline_exceeded from its next denoising step) before it
# gives up on the replica. A step or an image decode can outlast the deadline a little.
REPLY_GRACE_S = 5.0
# Read-only ops that read the whole model on every replica: shared and bounded
# (dpserve/router/coalesce.py), not one fan-out per caller.
HEAVY_READS = frozenset({"get_weights_checksum"})
HEAVY_READ_WAITERS = 8


class Stage(Protocol):
    """Told where the request is (dpserve/router/registry.py's InFlight)."""

    def queued(self) -> None: ...
    def at_replica(self) -> None: ...


@dataclass(frozen=True)
class Generated:
    result: p.GenerateResult
    images: list[bytes]
    replica: str
    units: float = 0.0  # its estimated cost on that replica (dpserve/contract/cost.py)
    waited_s: float = 0.0  # in this router's queue for a slot, every try together


class RouterService:
    def __init__(self, pool: ReplicaPool, heavy_read_waiters: int = HEAVY_READ_WAITERS) -> None:
        self.pool = pool
        self.heavy_reads: Coalescer[FanoutAnswer] = Coalescer(heavy_read_waiters)

    # ------------------------------------------------------------ generation

    async def generate(
        self,
        params: p.GenerateParams,
        request_id: str | None = None,
        blobs: list[bytes] | None = None,
        on_partial: Callable[[p.Message], None] | None = None,
        stage: Stage | None = None,
        tenant: str = KEYLESS.tenant,
    ) -> Generated:
        """Serve on a replica; if it fails before replying, once more on another.

        The seeds are fixed before the first try, so a retry returns the bytes the
        first replica would have. The request timeout is one deadline for the whole
        request, waits and retry included; each replica is told the time left.
        ``request_id`` names it on the wire, the retry included (a cancel by id finds
        it); ``blobs`` go with it (an edit's uploads); ``on_partial`` gets its
        previews (a retry's come again from the start). ``tenant``: whose share of the
        replicas it waits in (docs/tenants.md, "Fair shares"); it goes with the request,
        so a cancel through another router reaches it only for its own tenant.
        """
        request_id = request_id or uuid.uuid4().hex
        params = pv.fill_seeds(params)
        timeout_s = self.pool.settings.request_timeout_s
        deadline = time.monotonic() + timeout_s
        tried: set[str] = set()
        last: Exception | None = None
        waited_s = 0.0
        for _ in range(2):
            if tried and deadline - time.monotonic() <= 0:
                break
            if stage is not None:
                stage.queued()
            asked = time.monotonic()
            slot = await self.pool.admission.acquire(
                tried, max(0.0, deadline - asked), params, tenant
            )
            waited_s += time.monotonic() - asked
            replica = slot.replica
            tried.add(replica.endpoint)
            if stage is not None:
                stage.at_replica()
            # The call owns the slot until the replica answers, even if our caller
            # (a client that went away) stops waiting for it: then the replica is told
            # to cancel, answers at its next denoising step, and the slot is free.
            call = asyncio.create_task(
                self._call(slot, params, request_id, deadline, blobs, on_partial, waited_s, tenant)
            )
            call.add_done_callback(retrieve)
            try:
                return await asyncio.shield(call)
            except asyncio.CancelledError:
                # The call's first step (it sends the request) was scheduled before
                # this task could resume, so the cancel follows the request.
                if not call.done():
                    self.pool.membership.cancel(replica, request_id)
                raise
            except p.RequestError as exc:
                if exc.code not in _RETRIABLE:
                    raise
                if exc.code == p.UNAVAILABLE:
                    # It is shutting down (a roll, a scale-down): out of rotation now, so
                    # the retry waits for another replica instead of asking it again
                    # before its next ping says "draining".
                    self.pool.health.mark_failed(replica, str(exc))
                last = exc
            except (ReplicaLost, TimeoutError) as exc:
                last = exc
            log.warning("replica %s failed a request (%s); retrying", replica.name, last)
        raise p.RequestError(p.UNAVAILABLE, f"no replica could serve the request: {last}")

    async def _call(
        self,
        slot: Slot,
        params: p.GenerateParams,
        request_id: str,
        deadline: float,
        blobs: list[bytes] | None,
        on_partial: Callable[[p.Message], None] | None,
        waited_s: float,
        tenant: str,
    ) -> Generated:
        replica = slot.replica
        try:
            left = deadline - time.monotonic()
            reply = await self.pool.membership.request(
                replica,
                p.GENERATE,
                params,
                max(0.0, left) + REPLY_GRACE_S,
                blobs,
                request_id=request_id,
                deadline_s=left,
                on_partial=on_partial,
                tenant=tenant,
            )
            result: p.GenerateResult = reply.body_as(p.GenerateResult)
            images = [reply.blobs[m.blob] for m in result.images]
        except (ReplicaLost, TimeoutError) as exc:
            self.pool.health.mark_failed(
                replica, f"request failed: {str(exc) or type(exc).__name__}"
            )
            raise
        except p.ProtocolError as exc:
            raise p.RequestError(
                p.INTERNAL, f"unreadable reply from {replica.name}: {exc}"
            ) from exc
        except IndexError:
            raise p.RequestError(p.INTERNAL, f"reply from {replica.name} lacks images") from None
        finally:
            self.pool.admission.release(slot)
        self.pool.admission.note_served(replica)
        self.pool.loras.learn(params.lora)
        return Generated(result, images, replica.name, slot.units, waited_s)

    async def cancel_elsewhere(self, request_id: str, scope: str | None = None) -> str:
        """Cancel a request this router does not hold (another router admitted it): every
        serving replica is asked to look among all its clients' work, for a request of
        ``scope``'s (dpserve/contract/owners.py; another tenant's is not found). The first that
        found it says where (``p.CANCEL_QUEUED``/``p.CANCEL_RUNNING``); else
        ``p.CANCEL_NOT_FOUND``. A replica that does not answer in a ping's time counts
        as not holding it."""
        timeout_s = self.pool.settings.ping_timeout_s

        async def ask(replica: Replica) -> str:
            try:
                return await self.pool.membership.cancel_any(replica, request_id, timeout_s, scope)
            except (ReplicaLost, TimeoutError, p.RequestError, p.ProtocolError) as exc:
                log.warning("cancel of %s not answered by %s: %s", request_id, replica.name, exc)
                return p.CANCEL_NOT_FOUND

        found = await asyncio.gather(*(ask(r) for r in self.pool.serving()))
        return next((f for f in found if f != p.CANCEL_NOT_FOUND), p.CANCEL_NOT_FOUND)

    # ------------------------------------------------------------ control

    async def control(self, op: str, args: dict[str, Any]) -> FanoutAnswer:
        """Send ``op`` to every replica at once and merge: first error wins."""
        pv.parse_control(p.ControlRequest(op=op, args=args))
        if op == p.SYNC_STATE:
            raise p.RequestError(p.UNSUPPORTED, "sync_state is internal to the router")
        if op in HEAVY_READS:
            doc, changing = self.pool.desired.doc, self.pool.control.changing
            # Shared only within one control state, and never across a change in flight.
            asked = json.dumps(args, sort_keys=True)
            key = (op, asked, doc.key) if doc is not None and not changing else None
            return await self.heavy_reads.run(key, lambda: self._read(op, args), op)
        if op not in p.MUTATING_OPS:
            return await self._read(op, args)
        outcomes, summary = await self.pool.control.change(op, args)
        answer = merge_fanout(op, outcomes, read_only=False)
        return FanoutAnswer(answer.status, {**answer.body, "control_state": summary}, answer.code)

    async def _read(self, op: str, args: dict[str, Any]) -> FanoutAnswer:
        replicas = self.pool.members()
        request = p.ControlRequest(op=op, args=args)
        outcomes = await asyncio.gather(*(self.pool.control.ask(r, request) for r in replicas))
        return merge_fanout(op, outcomes, read_only=True)
