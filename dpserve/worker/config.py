"""What one replica's gang is asked to run, shared by the supervisor and every rank."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dpserve.layout import ParallelConfig


@dataclass(frozen=True)
class WorkerConfig:
    model: Path
    port: int
    bind: str = "127.0.0.1"
    tp: int = 1
    sp: int = 1
    ulysses: int | None = None
    ring: int | None = None
    cfg: int = 1
    replica: int = 0
    threads_per_rank: int = 1
    device: str = "auto"  # auto, cpu or cuda
    dtype: str = "auto"  # auto, float32, bfloat16 or float16
    max_queue: int = 64
    max_side: int = 2048
    max_steps: int = 100
    warmup_steps: int = 2
    max_sequence_length: int | None = None  # text tokens; None: the pipeline's default
    tick_s: float = 2.0  # idle heartbeat through the gang, also keeps collectives from timing out
    stall_s: float = 120.0  # no progress for this long while busy: pings report "stalled"
    collective_timeout_s: float = 600.0
    drain_timeout_s: float = 300.0
    max_sessions: int = 8  # realtime sessions held at once
    max_session_mb: float = 256.0  # state one session may take
    session_idle_timeout_s: float = 60.0  # a session nobody stepped for this long is released

    @property
    def parallel(self) -> ParallelConfig:
        """The gang's own layout: one replica, whose ranks are 0..G-1."""
        return ParallelConfig(
            tp=self.tp, sp=self.sp, ulysses=self.ulysses or 1, ring=self.ring or 1, cfg=self.cfg
        )

    @property
    def gang_size(self) -> int:
        return self.parallel.gang_size

    @property
    def endpoint(self) -> str:
        return f"tcp://{self.bind}:{self.port}"
