"""A state-changing control op, through the desired state to every replica.

The router first asks every answering replica what it holds (pings come only every
interval, and another router's op may be a moment old), adopts the newest, and
checks and builds the op on it. The op's document is committed to the store
(compare-and-swap), then sent to every replica. Another router's op can still be
in the way at either step: stored first (a shared store, the ConfigMap), or
reaching a replica first. Either way this router has met a newer document than the
one it built on: it adopts it and builds the op again on top, in a document that
also replaces its own first one. That happens once; an op still in the way after
it (the state changed again meanwhile) is answered 409.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any, Final

from dpserve import protocol as p
from dpserve.control_state import ControlState, StateDoc, newest, reduce
from dpserve.router.desired import DesiredState
from dpserve.router.policies import ReplicaOutcome
from dpserve.router.pool import Replica, ReplicaPool

log = logging.getLogger(__name__)

ATTEMPTS: Final = 2  # the op as sent, then once on top of the newer state it met


async def change(
    pool: ReplicaPool, op: str, args: dict[str, Any]
) -> tuple[list[ReplicaOutcome], dict[str, Any]]:
    """Make the op's state the desired one, and bring every replica there.

    **Decision** (docs/router.md): the state is desired before it is sent, so
    a replica that joins meanwhile is brought there too. If no replica could
    take it, the state goes back (a new version holding the state before the op)
    and the answer is the replicas' error. If some could, the state stays: the
    others leave rotation, named with their reason, and are retried until they hold it.
    """
    desired = pool.desired
    async with desired.ops:
        with contextlib.suppress(Exception):  # unreachable store: go on with ours
            await desired.refresh()
        # What the replicas hold now, not at their last ping: another router's op of
        # a moment ago is the state this one is checked against and built on.
        await pool.recheck(r for r in pool.members() if r.answering)
        base = desired.doc
        if base is None:
            raise p.RequestError(
                p.UNAVAILABLE, "no replica has reported its control state yet; retry shortly"
            )
        run = _Run(pool, op, args)
        for attempt in range(ATTEMPTS):
            met = await run.attempt(base)
            if met is None:
                break
            base = met
            if attempt + 1 < ATTEMPTS:
                run.rebased_on = met
                log.info(
                    "%s met control state version %d (%s) of another router; applying it on top",
                    op,
                    met.version,
                    met.op or "boot",
                )
        final = await run.settle(base)
    return run.answer(final)


@dataclass
class _Run:
    """One op's attempts, and what they left."""

    pool: ReplicaPool
    op: str
    args: dict[str, Any]
    made: StateDoc | None = None  # the newest of its documents the store took
    sent: list[tuple[Replica, ReplicaOutcome]] = field(default_factory=list)  # the last fan-out
    stored_first: StateDoc | None = None  # another router's: the store refused the last one
    rebased_on: StateDoc | None = None

    async def attempt(self, base: StateDoc) -> StateDoc | None:
        """The op on top of ``base``, stored and sent; the newer document it met, if any."""
        top = newest(base, self.made)  # above this op's earlier document: it replaces that
        assert top is not None
        try:
            state = reduce(base.state, self.op, self.args, revision=top.version + 1)
        except p.RequestError:
            if self.made is not None:  # not an op for the state met: what took it goes back
                await self.settle(base, undo=True)
            raise
        doc = top.successor(self.op, state)
        try:
            stored = await self.pool.desired.commit(doc)
        except Exception as exc:
            raise p.RequestError(p.UNAVAILABLE, f"control state store: {exc}") from exc
        if stored.key != doc.key:
            self.stored_first, self.sent = stored, []
            return stored
        self.made, self.stored_first = doc, None
        self.sent = await _fan_out(self.pool, doc, base.state, self.op, self.args)
        return await _newer_held(self.pool, self.sent, doc)

    @property
    def taken(self) -> int:
        return sum(o.result is not None for _, o in self.sent)

    async def settle(self, back_to: StateDoc, undo: bool = False) -> StateDoc | None:
        """The state after the op: its document, or, when no replica took it, a version
        above all of its documents holding ``back_to``'s state."""
        final = self.made
        if self.made is not None and (undo or not self.taken):
            final = await _undo(self.pool.desired, newest(self.made, back_to), self.op, back_to)
        self.pool.state_changed()
        return final

    def answer(self, final: StateDoc | None) -> tuple[list[ReplicaOutcome], dict[str, Any]]:
        if self.stored_first is not None:
            raise p.RequestError(
                p.CONFLICT,
                f"other routers changed the control state twice while {self.op} was applied "
                f"(now version {self.stored_first.version}); retry",
            )
        assert final is not None
        outcomes = [o for _, o in self.sent]
        taken = self.taken
        summary = {
            "version": final.version,
            "digest": final.state.digest(),
            "applied": taken > 0,
            "replicas_holding": taken,
            "out_of_rotation_until_synced": [o.replica for o in outcomes if o.result is None]
            if taken
            else [],
            # The version of another router's state the op met and was applied on top of.
            "rebased_on": self.rebased_on.version if self.rebased_on is not None else None,
        }
        return outcomes, summary


async def _fan_out(
    pool: ReplicaPool, doc: StateDoc, before: ControlState, op: str, args: dict[str, Any]
) -> list[tuple[Replica, ReplicaOutcome]]:
    # Meanwhile replicas still holding the state before it serve on.
    pool.desired.before = before
    try:
        replicas = pool.members()
        outcomes = await asyncio.gather(*(pool.apply(r, doc, op, args) for r in replicas))
    finally:
        pool.desired.before = None
    return list(zip(replicas, outcomes, strict=True))


async def _newer_held(
    pool: ReplicaPool, sent: list[tuple[Replica, ReplicaOutcome]], doc: StateDoc
) -> StateDoc | None:
    """The newest document held by replicas that refused ``doc`` as not knowing theirs
    (asked again: a refusal names no document), when ``doc`` does not know it."""
    refused = [r for r, o in sent if o.error is not None and o.error.code == p.CONFLICT]
    if not refused:
        return None
    await pool.recheck(refused)
    held = newest(*(r.held for r in refused))
    return held if held is not None and not doc.knows(held) else None


async def _undo(
    desired: DesiredState, top: StateDoc | None, op: str, back_to: StateDoc
) -> StateDoc:
    """A version above this op's documents holding ``back_to``'s state: replicas that took
    none of them keep what they hold, and ones that took one are brought back."""
    assert top is not None
    final = top.successor(f"undo {op}", back_to.state)
    try:
        await desired.commit(final)
    except Exception as exc:  # the replicas still hold the old state
        log.warning("control state store: undo not stored: %s", exc)
    return final
