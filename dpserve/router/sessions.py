"""Realtime sessions through the router: placement, and every message to the owner.

A new session gets a random key; rendezvous hashing of the key over the serving
replicas orders where it may live (replicas that report being full go last).
The owner's endpoint is written into the session id the client receives, so any
router (this one after a restart, or another replica of the router) sends the
session's messages to the same replica without shared state, and replicas that
join later never move it. Nothing here retries a session on another replica:
its state lives on the owner only, so when the owner is gone, so is the session.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from dataclasses import dataclass

import msgspec

from dpserve.contract import protocol as p
from dpserve.contract import realtime as rt
from dpserve.contract.ids import decode_owner, encode_owner
from dpserve.router.connection import ReplicaLost
from dpserve.router.policies import hrw_order
from dpserve.router.pool import ReplicaPool
from dpserve.router.replica import Replica

log = logging.getLogger(__name__)

_SEPARATOR = "."
_CLOSE_TIMEOUT_S = 5.0


class SessionLost(Exception):
    """The owner no longer holds the session's state; the client must open a new one."""


class SessionMoved(Exception):
    """Another connection resumed the session; this one no longer drives it."""


def make_session_id(key: str, owner: str) -> str:
    return f"{key}{_SEPARATOR}{encode_owner(owner)}"


def session_owner(session_id: str) -> str:
    """The owner's endpoint recorded in a session id; a malformed id is the client's error."""
    key, _, encoded = session_id.partition(_SEPARATOR)
    owner = decode_owner(encoded)
    if not key or owner is None:
        raise p.RequestError(
            p.INVALID_REQUEST, f"{session_id!r} is not a session id this service gave out"
        )
    return owner


@dataclass(frozen=True)
class Attached:
    """This connection's hold on a session: the owner and the epoch it drives."""

    session_id: str
    owner: str
    epoch: int


@dataclass(frozen=True)
class Frame:
    meta: rt.FrameResult
    content: bytes


class SessionRouter:
    def __init__(self, pool: ReplicaPool) -> None:
        self.pool = pool

    async def open(self, init: rt.ClientInit, tenant: str = "") -> tuple[Attached, Frame]:
        """Place a new session of ``tenant`` (its owner replica records it) and render its
        first frame."""
        # Its adapters' names resolved to their paths (docs/lora.md, Names).
        params = msgspec.structs.replace(
            init.params, lora=self.pool.loras.resolve_refs(init.params.lora)
        )
        key = secrets.token_hex(16)
        serving = {r.endpoint: r for r in self.pool.serving()}
        if not serving:
            raise p.RequestError(p.UNAVAILABLE, "no replica is serving yet; retry shortly")
        order = [serving[e] for e in hrw_order(key, serving)]
        blobs = [init.first_frame] if init.first_frame is not None else []
        lost: list[str] = []
        # Replicas whose last ping said "full" go last, not away: the ping may be stale,
        # and the replica's own answer is the one that counts.
        for replica in sorted(order, key=lambda r: r.full):
            session_id = make_session_id(key, replica.endpoint)
            request = rt.SessionRequest(
                action=rt.OPEN,
                session_id=session_id,
                params=params,
                first_frame=0 if blobs else None,
                tenant=tenant,
            )
            try:
                reply = await self._send(replica, request, blobs)
            except p.RequestError as exc:
                if exc.code != p.OVERLOADED:
                    raise
                self.pool.admission.session_refused(replica)
                log.info("replica %s refused a session: %s", replica.name, exc)
                continue
            except (ReplicaLost, TimeoutError) as exc:
                self.pool.health.mark_failed(replica, f"session open failed: {exc}")
                lost.append(replica.name)
                continue
            self.pool.admission.session_opened(replica)
            self.pool.loras.learn(params.lora)
            return Attached(session_id, replica.endpoint, 0), _frame(reply, replica)
        if lost:
            raise p.RequestError(
                p.UNAVAILABLE,
                f"no replica could take the session ({', '.join(lost)} failed, any others "
                "are full); retry shortly",
            )
        limit = max(r.max_sessions for r in order)
        raise p.RequestError(
            p.OVERLOADED,
            f"all {len(order)} serving replicas hold their maximum of {limit} realtime sessions"
            "; close a session or retry later",
        )

    async def resume(
        self, session_id: str, scope: str | None = None
    ) -> tuple[Attached, rt.SessionInfo]:
        """Attach to a live session of ``scope``'s (another tenant's is not found, as an
        unknown one); the connection that drove it before is told so."""
        owner = self._owner(session_id)
        request = rt.SessionRequest(action=rt.RESUME, session_id=session_id, scope=scope)
        reply = await self._to_owner(owner, session_id, request)
        info: rt.SessionInfo = reply.body_as(rt.SessionInfo)
        return Attached(session_id, owner.endpoint, info.epoch), info

    async def step(self, session: Attached, prompt: str | None) -> Frame:
        owner = self._owner(session.session_id)
        request = rt.SessionRequest(
            action=rt.STEP, session_id=session.session_id, epoch=session.epoch, prompt=prompt
        )
        return _frame(await self._to_owner(owner, session.session_id, request), owner)

    async def close(self, session: Attached) -> None:
        """Release the state on the owner, and nowhere else; best effort."""
        replica = self.pool.replicas.get(session.owner)
        if replica is None:
            return
        request = rt.SessionRequest(
            action=rt.CLOSE, session_id=session.session_id, epoch=session.epoch
        )
        try:
            reply = await self.pool.membership.request(
                replica, p.SESSION, request, _CLOSE_TIMEOUT_S
            )
            info: rt.SessionInfo = reply.body_as(rt.SessionInfo)
        except (ReplicaLost, TimeoutError, p.RequestError, p.ProtocolError) as exc:
            log.warning("releasing session %s failed: %s", session.session_id, exc)
            return
        if info.released:
            self.pool.admission.session_closed(replica)

    # ------------------------------------------------------------ plumbing

    def _owner(self, session_id: str) -> Replica:
        endpoint = session_owner(session_id)
        replica = self.pool.replicas.get(endpoint)
        if replica is None:
            raise SessionLost(
                f"the replica that held session {session_id} ({endpoint}) has left the service; "
                "its state was lost; open a new session"
            )
        return replica

    async def _to_owner(
        self, owner: Replica, session_id: str, request: rt.SessionRequest
    ) -> p.Message:
        try:
            return await self._send(owner, request, [])
        except (ReplicaLost, TimeoutError) as exc:
            raise SessionLost(
                f"replica {owner.name} that held session {session_id} failed "
                f"({exc or 'timed out'}); its state was lost; open a new session"
            ) from exc
        except p.RequestError as exc:
            if exc.code == p.CONFLICT and request.action == rt.STEP:
                raise SessionMoved(str(exc)) from exc
            if exc.code in (p.NOT_FOUND, p.INTERNAL):
                raise SessionLost(f"{exc}; open a new session") from exc
            raise

    async def _send(
        self, replica: Replica, request: rt.SessionRequest, blobs: list[bytes]
    ) -> p.Message:
        # The call finishes even if its caller is cancelled (a client that left):
        # the replica then holds what it did, and close releases it.
        call = asyncio.ensure_future(
            self.pool.membership.request(
                replica, p.SESSION, request, self.pool.settings.request_timeout_s, blobs
            )
        )
        call.add_done_callback(lambda done: done.cancelled() or done.exception())
        return await asyncio.shield(call)


def _frame(reply: p.Message, replica: Replica) -> Frame:
    try:
        meta: rt.FrameResult = reply.body_as(rt.FrameResult)
        return Frame(meta, reply.blobs[meta.blob])
    except (p.ProtocolError, IndexError) as exc:
        raise p.RequestError(p.INTERNAL, f"unreadable frame from {replica.name}: {exc}") from None
