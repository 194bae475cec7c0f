"""What the driver relays to its gang: one command per loop turn, msgpack-encoded."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Final

import msgspec

from dpserve.contract.cost import Calibration
from dpserve.contract.protocol import (
    AdapterReport,
    ControlRequest,
    GenerateParams,
)
from dpserve.contract.realtime import SessionRequest
from dpserve.worker.load import BusyWindow

TICK: Final = "tick"  # idle heartbeat: proves the gang is alive, keeps collectives warm
STOP: Final = "stop"


class Generation(msgspec.Struct, frozen=True, kw_only=True):
    """One generation request of a batch: its own id and parameters."""

    id: str
    params: GenerateParams


class GangCommand(msgspec.Struct, kw_only=True):
    kind: str  # protocol.GENERATE, protocol.CONTROL, protocol.SESSION, TICK or STOP
    id: str = ""  # a batch's: its first request's
    # GENERATE: the requests that run as one pipeline call, in queue order (worker/batch.py).
    batch: list[Generation] = msgspec.field(default_factory=list)
    control: ControlRequest | None = None
    session: SessionRequest | None = None
    # A session's starting image, or an edit's uploads (an edit runs in a batch of one).
    blobs: list[bytes] = msgspec.field(default_factory=list)


_ENCODER: Final = msgspec.msgpack.Encoder()
_DECODER: Final = msgspec.msgpack.Decoder(GangCommand)


def encode_command(command: GangCommand) -> bytes:
    return _ENCODER.encode(command)


def decode_command(payload: bytes) -> GangCommand:
    return _DECODER.decode(payload)


@dataclass
class GangStatus:
    """Written by the gang loop, read by the driver's socket thread to answer pings.

    Plain attribute writes are atomic under the GIL, which is all the sharing needs;
    the calibration and the busy window hold locks of their own.
    """

    progress_at: float = 0.0  # monotonic time of the last loop turn or denoiser call
    served: int = 0
    released: bool = False
    control: dict[str, Any] | None = None  # the control state document held (ControlOps.held)
    sessions: int = 0
    session_bytes: int = 0
    max_batch: int = 1  # --max-batch, reported in pings (the router's per-replica cap)
    # Seconds per cost unit, observed by the output rank after each generation
    # (dpserve.contract.cost).
    calibration: Calibration = field(default_factory=Calibration)
    load: BusyWindow = field(default_factory=BusyWindow)  # busy_fraction's window
    # The LoRA adapter cache's report, replaced whole after each change (worker/lora_cache.py).
    adapters: AdapterReport | None = None

    @property
    def busy(self) -> bool:
        return self.load.busy

    @busy.setter
    def busy(self, value: bool) -> None:
        # The gang loop's plain `status.busy = ...` writes also feed the busy window.
        self.load.set(value, time.monotonic())

    @property
    def busy_fraction(self) -> float:
        return self.load.fraction(time.monotonic())
