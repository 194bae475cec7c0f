"""The control plane: the control state every replica should hold, and getting it there.

:class:`ControlPlane` is the one owner of the router's side of the control state
(dpserve/contract/control_state.py): the desired document (kept and adopted by
:class:`~dpserve.router.desired.DesiredState`, in a store), the state a fan-out is
moving replicas from, the lock that makes this router change the state one op at a
time, and one sync task per replica that does not hold the desired state. It also
judges rotation: a replica serves only when it answers pings, reports ``ok``, has
described its model, and holds a state the plane accepts (the desired one, or,
while this router fans an op out, the one before it, so each gang switches between
two of its requests).

**A state-changing op** (:meth:`ControlPlane.change`). The router first asks every
answering replica what it holds (pings come only every interval, and another
router's op may be a moment old), adopts the newest, and checks and builds the op
on it. The op's document is committed to the store (compare-and-swap), then sent
to every replica. Another router's op can still be in the way at either step:
stored first (a shared store, the ConfigMap), or reaching a replica first. Either
way this router has met a newer document than the one it built on: it adopts it and
builds the op again on top, in a document that also replaces its own first one.
That happens once; an op still in the way after it (the state changed again
meanwhile) is answered 409.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Final

from dpserve.contract import protocol as p
from dpserve.contract.control_state import ControlState, StateDoc, newest, parse_doc, reduce
from dpserve.router.connection import ReplicaLost
from dpserve.router.desired import DesiredState, OutOfSync
from dpserve.router.health import Health
from dpserve.router.membership import Membership
from dpserve.router.policies import ReplicaOutcome
from dpserve.router.replica import Replica

log = logging.getLogger(__name__)

ATTEMPTS: Final = 2  # the op as sent, then once on top of the newer state it met


class ControlPlane:
    def __init__(
        self,
        members: Membership,
        health: Health,
        desired: DesiredState,
        wake: Callable[[], None],
        timeout_s: float,
        backoff_max_s: float,
        follow_s: float,
    ) -> None:
        """``wake``: told when a replica may have joined rotation (admission's waiters);
        ``timeout_s`` bounds one control op on one replica; a failing sync retries
        after up to ``backoff_max_s``; the store is read every ``follow_s``."""
        self.members = members
        self.health = health
        self.desired = desired
        self._wake = wake
        self.timeout_s = timeout_s
        self.backoff_max_s = backoff_max_s
        self.follow_s = follow_s
        # While this router fans an op out, replicas still holding the state before
        # it keep serving: each gang switches between two of its requests.
        self._before: ControlState | None = None
        self._ops = asyncio.Lock()  # this router changes the state one op at a time
        self._syncs: dict[str, asyncio.Task[None]] = {}
        self._follow: asyncio.Task[None] | None = None

    @property
    def changing(self) -> bool:
        """Whether this router is applying an op now."""
        return self._ops.locked()

    def start(self) -> None:
        """Follow the store from now on (other routers' ops)."""
        self._follow = asyncio.create_task(self._follow_store(), name="control state")

    def stop_sync(self, endpoint: str) -> None:
        task = self._syncs.pop(endpoint, None)
        if task is not None:
            task.cancel()

    def tasks(self) -> list[asyncio.Task[None]]:
        follow = [self._follow] if self._follow is not None else []
        return [*self._syncs.values(), *follow]

    # ------------------------------------------------------------ rotation

    def accepts(self, state: ControlState | None) -> bool:
        """Whether a replica holding ``state`` may serve."""
        doc = self.desired.doc
        if state is None or doc is None:
            return False
        return state == doc.state or (self._before is not None and state == self._before)

    def adopt(self, held: StateDoc | None) -> None:
        """A document a replica reported: a newer one becomes the desired state (another
        router's op, or a restarted router's), and every replica is judged again."""
        if self.desired.observe(held):
            self.settle_all()

    def settle(self, replica: Replica) -> None:
        """Derive whether the replica serves; start its sync when it needs one."""
        if replica.endpoint not in self.members.replicas:
            return
        state = replica.held.state if replica.held is not None else None
        accepted = self.accepts(state)
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
            log.warning("replica %s out of rotation: %s", replica.name, self.why_not(replica))
        replica.serving = serving
        self._wake()

    def settle_all(self) -> None:
        """Judge every replica again (the desired state moved)."""
        for replica in self.members.members():
            self.settle(replica)

    def why_not(self, replica: Replica) -> str:
        """Why ``replica`` does not serve."""
        doc = self.desired.doc
        if not replica.answering or replica.status != "ok":
            return replica.last_error or replica.status
        if replica.sync_error:
            return replica.sync_error
        if replica.info_error:  # it answers, but describes its model in a shape we cannot read
            return replica.info_error
        if doc is not None and not self.accepts(replica.held.state if replica.held else None):
            return f"catching up to control state version {doc.version}"
        return "starting"

    def out_of_sync(self) -> OutOfSync:
        """Replicas that tried and failed to reach the desired state (not ones still
        catching up: that is a few seconds of normal start-up), with the reason."""
        return {
            r.endpoint: r.sync_error
            for r in self.members.members()
            if r.answering and r.sync_error and not r.serving
        }

    # ------------------------------------------------------------ sync

    def _start_sync(self, replica: Replica) -> None:
        if self._before is not None:
            return  # a fan-out is bringing every replica along
        task = self._syncs.get(replica.endpoint)
        if task is None or task.done():
            self._syncs[replica.endpoint] = asyncio.create_task(
                self._sync(replica), name=f"sync {replica.name}"
            )

    async def _sync(self, replica: Replica) -> None:
        """Bring one replica to the desired state, retrying with backoff while it fails."""
        backoff = 1.0
        while replica.answering and self.members.holds(replica):
            doc = self.desired.doc
            if doc is None or self._before is not None:
                return
            if replica.held is not None and replica.held.state == doc.state:
                break
            outcome = await self.apply(replica, doc, p.SYNC_STATE, {})
            if outcome.error is None:
                break
            await asyncio.sleep(backoff)
            backoff = min(2 * backoff, self.backoff_max_s)
        self.settle(replica)

    async def _follow_store(self) -> None:
        """Follow the stored state (other routers' ops) and publish who is out of sync."""
        while True:
            await asyncio.sleep(self.follow_s)
            try:
                before = self.desired.doc
                await self.desired.refresh()
                if self.desired.doc is not before:
                    self.settle_all()
                await self.desired.report(self.out_of_sync(), set(self.members.replicas))
            except Exception as exc:  # keep serving on the state we have
                log.warning("control state store: %s", exc)

    # ------------------------------------------------------------ one replica

    async def ask(self, replica: Replica, request: p.ControlRequest) -> ReplicaOutcome:
        """One control op on one replica, as its part of a fan-out; a replica lost on the
        way leaves rotation."""
        if not replica.answering:
            return ReplicaOutcome(replica.name, skipped=f"down: {replica.last_error}")
        try:
            reply = await replica.conn.request(p.CONTROL, request, self.timeout_s)
            body: p.ControlResult = reply.body_as(p.ControlResult)
        except p.RequestError as exc:
            return ReplicaOutcome(replica.name, error=exc.body())
        except (ReplicaLost, TimeoutError) as exc:
            self.health.mark_failed(replica, f"control op failed: {str(exc) or 'timed out'}")
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

    # ------------------------------------------------------------ a state-changing op

    async def change(
        self, op: str, args: dict[str, Any]
    ) -> tuple[list[ReplicaOutcome], dict[str, Any]]:
        """Make the op's state the desired one, and bring every replica there.

        **Decision** (docs/router.md): the state is desired before it is sent, so
        a replica that joins meanwhile is brought there too. If no replica could
        take it, the state goes back (a new version holding the state before the op)
        and the answer is the replicas' error. If some could, the state stays: the
        others leave rotation, named with their reason, and are retried until they hold it.
        """
        async with self._ops:
            with contextlib.suppress(Exception):  # unreachable store: go on with ours
                await self.desired.refresh()
            # What the replicas hold now, not at their last ping: another router's op of
            # a moment ago is the state this one is checked against and built on.
            await self.health.recheck(r for r in self.members.members() if r.answering)
            base = self.desired.doc
            if base is None:
                raise p.RequestError(
                    p.UNAVAILABLE, "no replica has reported its control state yet; retry shortly"
                )
            run = _Run(self, op, args)
            for attempt in range(ATTEMPTS):
                met = await run.attempt(base)
                if met is None:
                    break
                base = met
                if attempt + 1 < ATTEMPTS:
                    run.rebased_on = met
                    log.info(
                        "%s met control state version %d (%s) of another router; "
                        "applying it on top",
                        op,
                        met.version,
                        met.op or "boot",
                    )
            final = await run.settle(base)
        return run.answer(final)

    async def fan_out(
        self, doc: StateDoc, before: ControlState, op: str, args: dict[str, Any]
    ) -> list[tuple[Replica, ReplicaOutcome]]:
        """Send ``doc`` to every replica; meanwhile ones still holding ``before`` serve on."""
        with self._moving_from(before):
            replicas = self.members.members()
            outcomes = await asyncio.gather(*(self.apply(r, doc, op, args) for r in replicas))
        return list(zip(replicas, outcomes, strict=True))

    @contextlib.contextmanager
    def _moving_from(self, before: ControlState) -> Iterator[None]:
        self._before = before
        try:
            yield
        finally:
            self._before = None


@dataclass
class _Run:
    """One op's attempts, and what they left."""

    plane: ControlPlane
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
            stored = await self.plane.desired.commit(doc)
        except Exception as exc:
            raise p.RequestError(p.UNAVAILABLE, f"control state store: {exc}") from exc
        if stored.key != doc.key:
            self.stored_first, self.sent = stored, []
            return stored
        self.made, self.stored_first = doc, None
        self.sent = await self.plane.fan_out(doc, base.state, self.op, self.args)
        return await self._newer_held(doc)

    async def _newer_held(self, doc: StateDoc) -> StateDoc | None:
        """The newest document held by replicas that refused ``doc`` as not knowing theirs
        (asked again: a refusal names no document), when ``doc`` does not know it."""
        refused = [r for r, o in self.sent if o.error is not None and o.error.code == p.CONFLICT]
        if not refused:
            return None
        await self.plane.health.recheck(refused)
        held = newest(*(r.held for r in refused))
        return held if held is not None and not doc.knows(held) else None

    async def _undo(self, top: StateDoc | None, back_to: StateDoc) -> StateDoc:
        """A version above this op's documents holding ``back_to``'s state: replicas that
        took none of them keep what they hold, and ones that took one are brought back."""
        assert top is not None
        final = top.successor(f"undo {self.op}", back_to.state)
        try:
            await self.plane.desired.commit(final)
        except Exception as exc:  # the replicas still hold the old state
            log.warning("control state store: undo not stored: %s", exc)
        return final

    @property
    def taken(self) -> int:
        return sum(o.result is not None for _, o in self.sent)

    async def settle(self, back_to: StateDoc, undo: bool = False) -> StateDoc | None:
        """The state after the op: its document, or, when no replica took it, a version
        above all of its documents holding ``back_to``'s state."""
        final = self.made
        if self.made is not None and (undo or not self.taken):
            final = await self._undo(newest(self.made, back_to), back_to)
        self.plane.settle_all()  # the desired state moved: every replica is judged again
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
