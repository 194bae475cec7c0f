"""What the driver relays to its gang: one command per loop turn, msgpack-encoded."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

import msgspec

from dpserve.protocol import ControlRequest, GenerateParams
from dpserve.realtime import SessionRequest

TICK: Final = "tick"  # idle heartbeat: proves the gang is alive, keeps collectives warm
STOP: Final = "stop"


class GangCommand(msgspec.Struct, kw_only=True):
    kind: str  # protocol.GENERATE, protocol.CONTROL, protocol.SESSION, TICK or STOP
    id: str = ""
    generate: GenerateParams | None = None
    control: ControlRequest | None = None
    session: SessionRequest | None = None
    blobs: list[bytes] = msgspec.field(default_factory=list)  # a session's starting image


_ENCODER: Final = msgspec.msgpack.Encoder()
_DECODER: Final = msgspec.msgpack.Decoder(GangCommand)


def encode_command(command: GangCommand) -> bytes:
    return _ENCODER.encode(command)


def decode_command(payload: bytes) -> GangCommand:
    return _DECODER.decode(payload)


@dataclass
class GangStatus:
    """Written by the gang loop, read by the driver's ingress thread to answer pings.

    Plain attribute writes are atomic under the GIL, which is all the sharing needs.
    """

    progress_at: float = 0.0  # monotonic time of the last loop turn or denoiser call
    busy: bool = False
    served: int = 0
    released: bool = False
    control: dict[str, Any] | None = None  # the control state document held (ControlOps.held)
    sessions: int = 0
    session_bytes: int = 0
    max_batch: int = 1  # --max-batch, reported in pings (the router's per-replica cap)
