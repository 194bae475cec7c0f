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
    first_gpu: int = 0  # the gang's ranks take GPUs first_gpu, first_gpu + 1, ...
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


def gpu_problem(device: str, gang_size: int, visible: int) -> str | None:
    """Why this gang cannot have one GPU per rank, or None.

    NCCL takes one GPU per rank of a communicator: two ranks of a gang on one GPU
    fail deep inside its first collective, so this is said before any rank starts.
    """
    if device == "cpu" or (device == "auto" and visible == 0):
        return None
    if visible == 0:
        return "--device cuda, but no CUDA device is visible"
    if gang_size > visible:
        return (
            f"a gang of {gang_size} ranks needs {gang_size} GPUs (one per rank) but "
            f"{visible} are visible: give it more (CUDA_VISIBLE_DEVICES) or fewer ranks"
        )
    return None


def gang_first_gpu(requested: int, gang_size: int, visible: int) -> int:
    """The GPU of rank 0: ``requested`` when the gang fits from there; else blocks of
    ``gang_size`` GPUs wrap around, so replicas beyond the GPUs share them (which
    works) while the ranks of one gang never do. Needs ``gang_size <= visible``."""
    if requested + gang_size <= visible:
        return requested
    return (requested // gang_size) % (visible // gang_size) * gang_size
