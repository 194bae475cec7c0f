"""``/v1/realtime_video/generate``: one WebSocket, one realtime session.

The first valid ``init`` (or ``resume``) attaches the socket to a session on its
owner replica. Then two tasks share the socket: a reader that takes prompt
changes and step requests, and a stepper that asks the owner for frames and
sends them as binary ``frame`` messages. A message with bad values gets an
``error`` and the socket stays usable (a bad ``init`` can be corrected); one that
is not a client message's shape at all (``rt.Malformed``) gets an ``error`` and
the socket closes (1007, or 1009 past its size). A client that has not sent a valid ``init`` (or
``resume``) within ``init_timeout_s`` of waiting is sent an ``init_timeout`` error
and closed (4008): an open socket that says nothing holds a connection slot. A
client that closes (or goes away) releases the session on its owner; a router
that restarts (close code 1012) leaves it for the client to ``resume`` through
any router until the replica's idle timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import msgspec
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from dpserve.contract import protocol as p
from dpserve.contract import realtime as rt
from dpserve.contract import validation as pv
from dpserve.router.served_model import check_model
from dpserve.router.sessions import Attached, Frame, SessionLost, SessionMoved, SessionRouter
from dpserve.router.tenants import principal_of

log = logging.getLogger(__name__)

SERVICE_RESTART: Final = 1012  # RFC 6455: the server restarts; the client may come back
SESSION_ENDED: Final = 1011  # the session ended on the server's side (its state was lost)
SESSION_TAKEN: Final = 4009  # another connection resumed the session
INIT_TIMEOUT: Final = 4008  # no init (or resume) in time: HTTP 408's twin


@dataclass(frozen=True)
class RealtimeSettings:
    send_timeout_s: float = 30.0  # a client that reads nothing for this long is gone
    # Waiting for the client's init (or resume); time a replica spends opening the
    # session is not counted, so a refused init leaves the client the rest.
    init_timeout_s: float = 10.0


@dataclass
class _Drive:
    """What the reader hands the stepper."""

    options: rt.StreamOptions
    prompt: str | None = None  # a new prompt, not yet sent to the owner
    wanted: int = 0  # step mode: frames asked for and not yet rendered
    frames: int = 0  # rendered by this connection

    def __post_init__(self) -> None:
        self.wake = asyncio.Event()


def encode(kind: str, **fields: Any) -> bytes:
    return msgspec.msgpack.encode({"type": kind, **fields})


def frame_message(frame: Frame) -> bytes:
    meta = frame.meta
    return encode(
        "frame",
        content=frame.content,  # msgpack bin: no base64 anywhere
        session_id=meta.session_id,
        index=meta.index,
        replica=meta.replica,
        format=meta.format,
        width=meta.width,
        height=meta.height,
        inference_time_s=round(meta.inference_time_s, 4),
        state_bytes=meta.state_bytes,
    )


class RealtimeConnection:
    def __init__(
        self,
        ws: WebSocket,
        sessions: SessionRouter,
        limits: Callable[[], pv.Limits],
        settings: RealtimeSettings,
        served: Callable[[], str | None] = lambda: None,
        counted: Callable[[float], None] = lambda inference_s: None,
    ) -> None:
        self.ws = ws
        self.sessions = sessions
        self.limits = limits
        self.settings = settings
        self.served = served  # the served model's name, which an init's model must be
        self.counted = counted  # each frame sent, for its tenant's usage (its pipeline time)
        self.attached: Attached | None = None  # set as soon as the owner holds a session

    async def run(self) -> None:
        await self.ws.accept()
        release, ended = True, False
        try:
            drive = await self._attach()
            if drive is not None:
                assert self.attached is not None
                release = await self._drive(self.attached, drive)
            ended = True
        except WebSocketDisconnect as exc:
            release = exc.code != SERVICE_RESTART
        finally:
            attached = self.attached
            if attached is not None and release:
                await self.sessions.close(attached)
            elif attached is not None:
                log.info("session %s kept for a resume (router restart)", attached.session_id)
        # The client's own ``close`` ends here with the socket still open (after the
        # release, so the state is gone once the client sees it): a normal closure
        # (1000), not a connection dropped without a close frame (1006).
        if ended and self.ws.application_state == WebSocketState.CONNECTED:
            await self.ws.close(1000)

    # ------------------------------------------------------------ attaching

    async def _attach(self) -> _Drive | None:
        """Until a valid init or resume: bad ones get an error and another chance.
        None: the client sent ``close`` instead."""
        left = self.settings.init_timeout_s
        while True:
            started = time.monotonic()
            try:
                async with asyncio.timeout(max(0.0, left)):
                    message = await self._receive()
            except TimeoutError:
                waited = self.settings.init_timeout_s
                why = f"no init (or resume) message within {waited:g}s; send init first"
                await self._end(why, "init_timeout", INIT_TIMEOUT)
                raise WebSocketDisconnect(INIT_TIMEOUT, why) from None
            left -= time.monotonic() - started
            kind = message.type
            try:
                if isinstance(message, rt.InitMessage):
                    check_model(message.model, self.served())
                    init = rt.parse_init(message, self.limits())
                    tenant = principal_of(self.ws.scope).tenant
                    self.attached, first = await self.sessions.open(init, tenant)
                    replica = first.meta.replica
                    await self._ack(self.attached, replica, init.options, resumed=False, frames=1)
                    self.counted(first.meta.inference_time_s)
                    await self._send(frame_message(first))
                    return _Drive(init.options, frames=1)
                if isinstance(message, rt.ResumeMessage):
                    session_id, options = rt.parse_resume(message)
                    scope = principal_of(self.ws.scope).scope
                    self.attached, info = await self.sessions.resume(session_id, scope)
                    await self._ack(
                        self.attached, info.replica, options, resumed=True, frames=info.frames
                    )
                    return _Drive(options)
                if kind == "close":
                    return None
                await self._error(f"send init (or resume) first; got {kind[:40]!r}")
            except p.RequestError as exc:
                await self._error(str(exc), exc.code)
            except SessionLost as exc:
                await self._error(str(exc), "session_lost")

    async def _ack(
        self,
        attached: Attached,
        replica: int,
        options: rt.StreamOptions,
        resumed: bool,
        frames: int,
    ) -> None:
        """``replica``: the owner's index as it says itself, the integer every frame carries."""
        await self._send(
            encode(
                "init_ack",
                session_id=attached.session_id,
                replica=replica,
                resumed=resumed,
                frames=frames,
                mode=options.mode,
            )
        )

    # ------------------------------------------------------------ driving

    async def _drive(self, attached: Attached, drive: _Drive) -> bool:
        """Read and render until one side ends; True when the session should be released."""
        reader = asyncio.create_task(self._read(drive), name="realtime reader")
        stepper = asyncio.create_task(self._step(attached, drive), name="realtime stepper")
        try:
            done, _ = await asyncio.wait({reader, stepper}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (reader, stepper):
                task.cancel()
            for task in (reader, stepper):
                with contextlib.suppress(asyncio.CancelledError, WebSocketDisconnect):
                    await task
        # The stepper's verdict first: after it ended a lost or moved session, the
        # reader sees the close it caused, which must not count as the client leaving.
        finished = stepper if stepper in done else reader
        return bool(finished.result())  # a disconnect re-raises here and is handled by run()

    async def _read(self, drive: _Drive) -> bool:
        while True:
            message = await self._receive()
            kind = message.type
            try:
                if isinstance(message, rt.PromptMessage):
                    drive.prompt = rt.parse_prompt(message)
                elif kind == "step":
                    if drive.options.mode != "step":
                        raise p.RequestError(p.INVALID_REQUEST, "step messages need mode=step")
                    drive.wanted += 1
                    drive.wake.set()
                elif kind == "close":
                    return True
                elif kind in ("init", "resume"):
                    raise p.RequestError(
                        p.INVALID_REQUEST,
                        "this socket already carries a session; open another socket for another",
                    )
                elif kind == "video":
                    raise p.RequestError(
                        p.UNSUPPORTED, "video input is not supported: this model renders images"
                    )
                else:
                    raise p.RequestError(
                        p.INVALID_REQUEST,
                        f"unknown message type {kind[:40]!r}; known: prompt, step, close",
                    )
            except p.RequestError as exc:
                await self._error(str(exc), exc.code)

    async def _step(self, attached: Attached, drive: _Drive) -> bool:
        options = drive.options
        interval = 1.0 / options.fps if options.fps else 0.0
        next_at = time.monotonic()
        while options.max_frames is None or drive.frames < options.max_frames:
            if options.mode == "step":
                while drive.wanted <= 0:
                    drive.wake.clear()
                    await drive.wake.wait()
                drive.wanted -= 1
            elif interval:
                await asyncio.sleep(max(0.0, next_at - time.monotonic()))
                next_at = max(next_at + interval, time.monotonic())
            prompt, drive.prompt = drive.prompt, None
            try:
                frame = await self.sessions.step(attached, prompt)
            except SessionLost as exc:
                await self._end(str(exc), "session_lost", SESSION_ENDED)
                return False
            except SessionMoved as exc:
                await self._end(str(exc), "session_moved", SESSION_TAKEN)
                return False
            except p.RequestError as exc:
                if prompt is not None and drive.prompt is None:
                    drive.prompt = prompt  # not applied: keep it for the next frame
                await self._error(str(exc), exc.code)
                await asyncio.sleep(0.5)  # a refusing replica is not asked in a tight loop
                continue
            drive.frames += 1
            self.counted(frame.meta.inference_time_s)
            await self._send(frame_message(frame))
        await self._send(encode("done", session_id=attached.session_id, frames=drive.frames))
        await self.ws.close(1000)
        return True

    # ------------------------------------------------------------ socket

    async def _receive(self) -> rt.ClientMessage:
        """The next message, typed; a malformed one ends the connection: an ``error``
        that says why, then a close (``WebSocketDisconnect`` for ``run``)."""
        event = await self.ws.receive()
        if event["type"] == "websocket.disconnect":
            raise WebSocketDisconnect(event.get("code", 1000), event.get("reason"))
        raw = event.get("bytes")
        try:
            return rt.decode_client(raw if raw is not None else event.get("text", ""))
        except rt.Malformed as exc:
            await self._end(str(exc), exc.code, exc.close_code)
            raise WebSocketDisconnect(exc.close_code, str(exc)) from None

    async def _send(self, data: bytes) -> None:
        try:
            await asyncio.wait_for(self.ws.send_bytes(data), self.settings.send_timeout_s)
        except TimeoutError:
            log.warning("a realtime client read nothing for %gs", self.settings.send_timeout_s)
            raise WebSocketDisconnect(1001, "client stopped reading") from None

    async def _error(self, message: str, code: str = p.INVALID_REQUEST) -> None:
        await self._send(encode("error", content=message, code=code))

    async def _end(self, message: str, code: str, close_code: int) -> None:
        await self._error(message, code)
        if self.ws.application_state == WebSocketState.CONNECTED:
            # A close reason is at most 123 bytes of UTF-8.
            reason = message.encode()[:120].decode(errors="ignore")
            await self.ws.close(close_code, reason)
