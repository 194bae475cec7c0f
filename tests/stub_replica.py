"""An in-process replica for router tests: the real wire protocol on a real ZMQ socket.

It holds a control state the way a worker does (dpserve.control_state: documents
ordered by version, whole states applied, refusals for older documents) and
answers pings, model_info, control ops and generations with a fixed PNG. What it
leaves out is the model: tests that need pixels or gangs use real workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import uuid
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio
from PIL import Image

from dpserve import protocol as p
from dpserve.control_state import StateDoc, answer, parse_doc, reduce
from dpserve.transport import bind_router
from dpserve.wire import Gatekeeper, WireKey


def _png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (16, 16), (10, 20, 30)).save(buf, format="PNG")
    return buf.getvalue()


@dataclass
class StubReplica:
    ctx: zmq.asyncio.Context
    replica: int = 0
    fail_paths: set[str] = field(default_factory=set)  # LoRA/weights folders it cannot load
    generate_s: float = 0.0  # how long a generation takes
    held: StateDoc = field(default_factory=StateDoc)
    boot_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    calls: list[str] = field(default_factory=list)  # control ops received, in order
    generated: int = 0
    stopped: asyncio.Event = field(default_factory=asyncio.Event)  # set: answers nothing
    late_pings: int = 0  # answer this many pings late (by late_ping_s): a lagging network
    late_ping_s: float = 1.0
    checksum_s: float = 0.0  # how long get_weights_checksum takes (it hashes the model)
    key: WireKey | None = None  # a CURVE server of this key, as a driver given one

    def __post_init__(self) -> None:
        # A gatekeeper is one per context: a secured stub has a context of its own.
        self._own_ctx = zmq.asyncio.Context() if self.key is not None else None
        ctx = self._own_ctx or self.ctx
        self.gate = Gatekeeper(ctx, self.key) if self.key is not None else None
        self.sock = bind_router(ctx, "tcp://127.0.0.1:0", key=self.key)
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._generating: set[asyncio.Task[None]] = set()
        self._task = asyncio.create_task(self._serve())
        self._png = _png()

    def reboot(self) -> None:
        """A restarted gang: same address, boot state."""
        self.held, self.boot_id = StateDoc(), uuid.uuid4().hex

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self.sock.close(linger=0)
        if self.gate is not None:
            self.gate.close()
        if self._own_ctx is not None:
            self._own_ctx.term()

    async def _serve(self) -> None:
        while True:
            identity, *frames = await self.sock.recv_multipart()
            if self.stopped.is_set():
                continue  # a SIGSTOPped process: nothing is read, nothing answered
            message = p.decode(frames)
            if message.kind == p.PING and self.late_pings:
                self.late_pings -= 1
                late = asyncio.create_task(self._late(identity, message))
                self._generating.add(late)
                late.add_done_callback(self._generating.discard)
                continue
            if message.kind == p.CONTROL and self.checksum_s:
                request = message.body_as(p.ControlRequest)
                if request.op == "get_weights_checksum":
                    self.calls.append(request.op)
                    task = asyncio.create_task(self._checksum(identity, message))
                    self._generating.add(task)
                    task.add_done_callback(self._generating.discard)
                    continue
            if message.kind == p.GENERATE:
                task = asyncio.create_task(self._generate(identity, message))
                self._generating.add(task)
                task.add_done_callback(self._generating.discard)
                continue
            try:
                reply = self._answer(message)
            except p.RequestError as exc:
                reply = p.encode_error(message.id, exc)
            await self.sock.send_multipart([identity, *reply])

    async def _late(self, identity: bytes, message: p.Message) -> None:
        await asyncio.sleep(self.late_ping_s)
        await self.sock.send_multipart([identity, *self._answer(message)])

    async def _checksum(self, identity: bytes, message: p.Message) -> None:
        await asyncio.sleep(self.checksum_s)
        result = {"checksums": {"transformer": self.held.state.digest()}}
        reply = p.ControlResult(op="get_weights_checksum", replica=self.replica, result=result)
        await self.sock.send_multipart([identity, *p.encode(p.RESULT, message.id, reply)])

    async def _generate(self, identity: bytes, message: p.Message) -> None:
        await asyncio.sleep(self.generate_s)
        if self.stopped.is_set():
            return
        self.generated += 1
        meta = p.ImageMeta(index=0, blob=0, seed=1, format="png", width=16, height=16)
        result = p.GenerateResult(
            images=[meta],
            replica=self.replica,
            inference_time_s=self.generate_s,
            queue_time_s=0.0,
            peak_memory_mb=0.0,
        )
        await self.sock.send_multipart(
            [identity, *p.encode(p.RESULT, message.id, result, [self._png])]
        )

    def _answer(self, message: p.Message) -> list[bytes]:
        if message.kind == p.PING:
            ping = p.PingResult(
                replica=self.replica,
                boot_id=self.boot_id,
                status="ok",
                busy=False,
                queue_depth=0,
                served=self.generated,
                released=self.held.state.released,
                progress_age_s=0.0,
                control=self.held.to_builtins(),
            )
            return p.encode(p.RESULT, message.id, ping)
        request: p.ControlRequest = message.body_as(p.ControlRequest)
        self.calls.append(request.op)
        result = self._control(request)
        return p.encode(
            p.RESULT,
            message.id,
            p.ControlResult(op=request.op, replica=self.replica, result=result),
        )

    def _control(self, request: p.ControlRequest) -> dict[str, Any]:
        if request.op == "model_info":
            return {"model_path": "/stub", "size_factor": 16, "parallel": {"sp": 1}}
        if request.op == "list_loras":
            return {"loaded": sorted(self.held.state.loras)}
        if request.state is None:
            raise p.RequestError(p.INVALID_REQUEST, "this stub takes states from routers only")
        doc = parse_doc(request.state)
        if doc.key < self.held.key:
            raise p.RequestError(p.CONFLICT, f"holds newer version {self.held.version}")
        wanted = {*doc.state.loras.values(), *(w.path for w in doc.state.weights.values())}
        bad = sorted(wanted & self.fail_paths)
        if bad:
            raise p.RequestError(p.INVALID_REQUEST, f"lora_path {bad[0]!r} does not exist")
        self.held = doc
        out = {} if request.op == p.SYNC_STATE else answer(request.op, request.args, doc.state)
        return {**out, "state": doc.to_builtins()}


def direct_state(op: str, args: dict[str, Any], base: StateDoc) -> StateDoc:
    """The document a router would make for ``op`` over ``base``."""
    return base.successor(op, reduce(base.state, op, args, base.version + 1))
