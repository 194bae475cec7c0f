"""The router's service layer: generation with one retry, control fan-out with a log."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from dpserve import protocol as p
from dpserve.router.connection import ReplicaLost
from dpserve.router.policies import FanoutAnswer, ReplicaOutcome, merge_fanout
from dpserve.router.pool import Replica, ReplicaPool

log = logging.getLogger(__name__)

# Replica-side refusals that say "this replica, not this request": try another one.
_RETRIABLE = frozenset({p.UNAVAILABLE, p.OVERLOADED})


@dataclass(frozen=True)
class Generated:
    result: p.GenerateResult
    images: list[bytes]
    replica: str


class RouterService:
    def __init__(self, pool: ReplicaPool) -> None:
        self.pool = pool

    # ------------------------------------------------------------ generation

    async def generate(self, params: p.GenerateParams) -> Generated:
        """Serve on a replica; if it fails before replying, once more on another.

        The seeds are fixed before the first try, so a retry returns the bytes the
        first replica would have.
        """
        params = p.fill_seeds(params)
        tried: set[str] = set()
        last: Exception | None = None
        for _ in range(2):
            replica = await self.pool.acquire(tried, self.pool.settings.request_timeout_s)
            tried.add(replica.endpoint)
            # The call owns the slot until the replica answers, even if our caller
            # (a client that went away) stops waiting for it.
            call = asyncio.create_task(self._call(replica, params))
            try:
                return await asyncio.shield(call)
            except p.RequestError as exc:
                if exc.code not in _RETRIABLE:
                    raise
                last = exc
            except (ReplicaLost, TimeoutError) as exc:
                last = exc
            log.warning("replica %s failed a request (%s); retrying", replica.name, last)
        raise p.RequestError(p.UNAVAILABLE, f"no replica could serve the request: {last}")

    async def _call(self, replica: Replica, params: p.GenerateParams) -> Generated:
        try:
            reply = await replica.conn.request(
                p.GENERATE, params, self.pool.settings.request_timeout_s
            )
            result: p.GenerateResult = reply.body_as(p.GenerateResult)
            images = [reply.blobs[m.blob] for m in result.images]
        except (ReplicaLost, TimeoutError) as exc:
            self.pool.mark_failed(replica, f"request failed: {exc or type(exc).__name__}")
            raise
        except p.ProtocolError as exc:
            raise p.RequestError(
                p.INTERNAL, f"unreadable reply from {replica.name}: {exc}"
            ) from exc
        except IndexError:
            raise p.RequestError(p.INTERNAL, f"reply from {replica.name} lacks images") from None
        finally:
            self.pool.release(replica)
        replica.served += 1
        return Generated(result, images, replica.name)

    # ------------------------------------------------------------ control

    async def control(self, op: str, args: dict[str, Any]) -> FanoutAnswer:
        """Send ``op`` to every replica at once and merge: first error wins.

        A state-changing op first takes its position in the control log; the
        replicas that apply it record that position. One that failed, was down
        or is still catching up leaves rotation and is replayed what it missed
        before it serves again.
        """
        p.parse_control(p.ControlRequest(op=op, args=args))
        if op == "noop":
            raise p.RequestError(p.UNSUPPORTED, "noop is internal to control-log replay")
        mutating = op in p.MUTATING_OPS
        if not mutating:
            replicas = list(self.pool.replicas.values())
            outcomes = await asyncio.gather(*(self._one(r, op, args, None) for r in replicas))
            return merge_fanout(op, outcomes, read_only=True)
        async with self.pool.control_lock:
            try:
                await self.pool.log.refresh()
                position = await self.pool.log.reserve(op, args)
            except Exception as exc:
                raise p.RequestError(p.UNAVAILABLE, f"control log unavailable: {exc}") from exc
            replicas = list(self.pool.replicas.values())
            outcomes = await asyncio.gather(*(self._one(r, op, args, position) for r in replicas))
            applied = [o.result is not None for o in outcomes]
            await self.pool.log.resolve(position, any(applied))
            for replica, ok in zip(replicas, applied, strict=True):
                if ok:
                    replica.applied = position
                elif any(applied):
                    replica.serving = False  # behind the others now: replayed before serving
            # Replicas that missed this position catch up now: a noop when nobody
            # applied it, else a retry (a replica that fails it again stays out).
            behind = [r for r, ok in zip(replicas, applied, strict=True) if r.answering and not ok]
            await asyncio.gather(*(self.pool.replay(r) for r in behind))
        return merge_fanout(op, outcomes, read_only=False)

    async def _one(
        self, replica: Replica, op: str, args: dict[str, Any], position: int | None
    ) -> ReplicaOutcome:
        if not replica.answering:
            return ReplicaOutcome(replica.name, skipped=f"down: {replica.last_error}")
        if position is not None and replica.applied < position - 1:
            # Applying this before what it missed would reorder its history.
            return ReplicaOutcome(replica.name, skipped="catching up; replayed later")
        request = p.ControlRequest(op=op, args=args, log_position=position)
        try:
            reply = await replica.conn.request(
                p.CONTROL, request, self.pool.settings.control_timeout_s
            )
        except p.RequestError as exc:
            return ReplicaOutcome(replica.name, error=exc.body())
        except (ReplicaLost, TimeoutError) as exc:
            self.pool.mark_failed(replica, f"control op failed: {exc}")
            error = p.ErrorBody(code=p.UNAVAILABLE, message=str(exc) or "timed out")
            return ReplicaOutcome(replica.name, error=error)
        body: p.ControlResult = reply.body_as(p.ControlResult)
        return ReplicaOutcome(replica.name, result=body.result)
