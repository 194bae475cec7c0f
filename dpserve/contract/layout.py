"""Process rank layout of a serving deployment.

A deployment is ``dp`` independent replicas ("gangs"). Each gang of
``G = tp * sp * cfg`` processes serves one request at a time with
tensor, sequence (Ulysses x ring) and CFG parallelism.

Axes are ordered ``tp-sp-cfg-dp`` with tp innermost and dp outermost::

    global_rank = tp + T * (sp + S * (cfg + C * dp))
    sp_rank     = ulysses + U * ring

so replica ``r`` owns the contiguous global ranks ``[r*G, (r+1)*G)`` and no
tp/sp/cfg group ever crosses a replica boundary. tp is innermost because
its collectives are the most frequent and smallest, so its ranks should be
adjacent (same node, fastest links).

Pure stdlib so the router and operator can use it without torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

__all__ = [
    "AXES",
    "Axis",
    "LayoutError",
    "ParallelConfig",
    "RankInfo",
    "all_groups",
    "describe",
    "rank_info",
    "rank_of",
    "replica_endpoint",
    "replica_endpoints",
    "replica_ranks",
]

# No "dp" axis: replicas share no collectives, so a cross-replica group is never needed.
Axis = Literal["tp", "sp", "ulysses", "ring", "cfg", "replica"]
AXES: tuple[Axis, ...] = get_args(Axis)

_MAX_PORT = 65535


class LayoutError(ValueError):
    """An impossible or inconsistent parallel layout or endpoint."""


def _check_positive_int(name: str, value: int) -> None:
    # bool is an int subclass; True as a degree is always a config bug.
    if type(value) is not int:
        raise LayoutError(f"{name} must be an int (got {value!r})")
    if value < 1:
        raise LayoutError(f"{name} must be >= 1 (got {value})")


@dataclass(frozen=True)
class ParallelConfig:
    """Parallel degrees of one deployment. Invalid combinations raise LayoutError.

    If ``sp > 1`` and neither ``ulysses`` nor ``ring`` is given, sequence
    parallelism is pure Ulysses (``ulysses = sp``). An explicit
    ``ulysses=1, ring=1`` is indistinguishable from the default and treated
    the same way (it could never satisfy ``ulysses * ring == sp`` anyway).
    """

    tp: int = 1
    sp: int = 1
    ulysses: int = 1
    ring: int = 1
    cfg: int = 1
    dp: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "sp", "ulysses", "ring", "cfg", "dp"):
            _check_positive_int(name, getattr(self, name))
        if self.sp > 1 and self.ulysses == 1 and self.ring == 1:
            # Frozen dataclass: normalising in __post_init__ needs object.__setattr__.
            object.__setattr__(self, "ulysses", self.sp)
        self._check_structure()

    def _check_structure(self) -> None:
        if self.cfg not in (1, 2):
            raise LayoutError(
                f"cfg must be 1 or 2 (got {self.cfg}): CFG-parallel splits the two "
                "branches of classifier-free guidance (conditional/unconditional)"
            )
        if self.ulysses * self.ring != self.sp:
            raise LayoutError(
                f"ulysses * ring must equal sp ({self.ulysses} * {self.ring} != {self.sp})"
            )

    @classmethod
    def from_world_size(
        cls,
        world_size: int,
        *,
        tp: int = 1,
        sp: int = 1,
        ulysses: int = 1,
        ring: int = 1,
        cfg: int = 1,
    ) -> ParallelConfig:
        """Derive ``dp`` from the total process count (e.g. ``--num-gpus``)."""
        _check_positive_int("world size", world_size)
        gang = cls(tp=tp, sp=sp, ulysses=ulysses, ring=ring, cfg=cfg)
        if world_size % gang.gang_size:
            raise LayoutError(
                f"world size {world_size} is not divisible by the gang size "
                f"{gang.gang_size} (tp*sp*cfg)"
            )
        return cls(
            tp=tp,
            sp=sp,
            ulysses=gang.ulysses,
            ring=ring,
            cfg=cfg,
            dp=world_size // gang.gang_size,
        )

    @property
    def gang_size(self) -> int:
        """Processes per replica: G = tp * sp * cfg."""
        return self.tp * self.sp * self.cfg

    @property
    def world_size(self) -> int:
        """Processes in the whole deployment: dp * G."""
        return self.dp * self.gang_size

    def validate(self, num_heads: int | None = None, *, world_size: int | None = None) -> None:
        """Check against the model and the launched process count; raise LayoutError.

        Ulysses all-to-all and TP both split attention heads, so heads must be
        divisible by ``ulysses * tp``. Ring attention passes K/V blocks and keeps
        every head, so ``ring`` does not enter this constraint.
        """
        self._check_structure()
        if num_heads is not None:
            _check_positive_int("attention heads", num_heads)
            split = self.ulysses * self.tp
            if num_heads % split:
                raise LayoutError(
                    f"attention heads ({num_heads}) must be divisible by ulysses * tp "
                    f"({split}); ring attention does not split heads"
                )
        if world_size is not None:
            _check_positive_int("world size", world_size)
            if world_size % self.gang_size:
                raise LayoutError(
                    f"world size {world_size} is not divisible by the gang size "
                    f"{self.gang_size} (tp*sp*cfg)"
                )
            if world_size != self.world_size:
                raise LayoutError(
                    f"world size {world_size} does not match dp * gang size "
                    f"({self.dp} * {self.gang_size} = {self.world_size})"
                )


def _geometry(config: ParallelConfig, axis: Axis) -> tuple[int, int]:
    """(stride, size) of an axis in global-rank space."""
    t, u, s = config.tp, config.ulysses, config.sp
    if axis == "tp":
        return 1, t
    if axis == "ulysses":
        return t, u
    if axis == "ring":
        return t * u, config.ring
    if axis == "sp":
        return t, s
    if axis == "cfg":
        return t * s, config.cfg
    if axis == "replica":
        # The whole gang is one contiguous block: stride 1, size G.
        return 1, config.gang_size
    raise LayoutError(f"unknown axis {axis!r}; expected one of {', '.join(AXES)}")


def _coord(config: ParallelConfig, axis: Axis, global_rank: int) -> int:
    stride, size = _geometry(config, axis)
    return (global_rank // stride) % size


def _group(config: ParallelConfig, axis: Axis, global_rank: int) -> tuple[int, ...]:
    stride, size = _geometry(config, axis)
    base = global_rank - ((global_rank // stride) % size) * stride
    return tuple(range(base, base + stride * size, stride))


def _check_rank(config: ParallelConfig, global_rank: int) -> None:
    if type(global_rank) is not int or not 0 <= global_rank < config.world_size:
        raise LayoutError(
            f"global rank {global_rank!r} is out of range for world size {config.world_size}"
        )


@dataclass(frozen=True)
class RankInfo:
    """Coordinates and process groups of one global rank.

    ``local_rank`` is the rank inside its replica (0..G-1), not the per-node
    LOCAL_RANK of torchrun. Groups are tuples of global ranks in ascending order.
    """

    global_rank: int
    replica: int
    local_rank: int
    tp_rank: int
    sp_rank: int
    ulysses_rank: int
    ring_rank: int
    cfg_rank: int
    tp_group: tuple[int, ...]
    sp_group: tuple[int, ...]
    ulysses_group: tuple[int, ...]
    ring_group: tuple[int, ...]
    cfg_group: tuple[int, ...]
    replica_group: tuple[int, ...]

    @property
    def is_driver(self) -> bool:
        """Receives requests for its replica. Per replica, never just global rank 0."""
        return self.local_rank == 0

    @property
    def is_output_rank(self) -> bool:
        """Returns results for its replica; the same process as the driver."""
        return self.local_rank == 0


def rank_info(config: ParallelConfig, global_rank: int) -> RankInfo:
    """Coordinates and groups of ``global_rank``."""
    _check_rank(config, global_rank)
    r = global_rank
    return RankInfo(
        global_rank=r,
        replica=r // config.gang_size,
        local_rank=_coord(config, "replica", r),
        tp_rank=_coord(config, "tp", r),
        sp_rank=_coord(config, "sp", r),
        ulysses_rank=_coord(config, "ulysses", r),
        ring_rank=_coord(config, "ring", r),
        cfg_rank=_coord(config, "cfg", r),
        tp_group=_group(config, "tp", r),
        sp_group=_group(config, "sp", r),
        ulysses_group=_group(config, "ulysses", r),
        ring_group=_group(config, "ring", r),
        cfg_group=_group(config, "cfg", r),
        replica_group=_group(config, "replica", r),
    )


def rank_of(
    config: ParallelConfig,
    *,
    replica: int = 0,
    tp_rank: int = 0,
    sp_rank: int = 0,
    cfg_rank: int = 0,
) -> int:
    """Global rank at the given coordinates (inverse of :func:`rank_info`).

    ``sp_rank`` is ``ulysses_rank + ulysses * ring_rank``.
    """
    coords = (
        ("replica", replica, config.dp),
        ("tp_rank", tp_rank, config.tp),
        ("sp_rank", sp_rank, config.sp),
        ("cfg_rank", cfg_rank, config.cfg),
    )
    for name, value, size in coords:
        if type(value) is not int or not 0 <= value < size:
            raise LayoutError(f"{name} {value!r} is out of range 0..{size - 1}")
    t, s, c = config.tp, config.sp, config.cfg
    return tp_rank + t * (sp_rank + s * (cfg_rank + c * replica))


def all_groups(config: ParallelConfig, axis: Axis) -> list[tuple[int, ...]]:
    """Every group along ``axis``, ordered by its lowest global rank.

    torch.distributed.new_group must be called by every process, for every
    group (even ones it is not in), in the same order, or it deadlocks or
    mismatches groups. Iterate this list as-is on all ranks.
    """
    stride, size = _geometry(config, axis)
    return [
        _group(config, axis, r)
        for r in range(config.world_size)
        if (r // stride) % size == 0  # a group's lowest member has axis coordinate 0
    ]


def replica_ranks(config: ParallelConfig, replica: int) -> range:
    """The contiguous global ranks of ``replica``: [replica*G, (replica+1)*G)."""
    if type(replica) is not int or not 0 <= replica < config.dp:
        raise LayoutError(f"replica {replica!r} is out of range for dp {config.dp}")
    g = config.gang_size
    return range(replica * g, (replica + 1) * g)


def _check_port(scheduler_port: int, replica: int) -> int:
    if type(scheduler_port) is not int or not 1 <= scheduler_port <= _MAX_PORT:
        raise LayoutError(f"scheduler port {scheduler_port!r} must be in 1..{_MAX_PORT}")
    if type(replica) is not int or replica < 0:
        raise LayoutError(f"replica must be >= 0 (got {replica!r})")
    port = scheduler_port + replica
    if port > _MAX_PORT:
        raise LayoutError(
            f"port {port} for replica {replica} (scheduler port {scheduler_port} + {replica}) "
            f"is outside the valid port range 1..{_MAX_PORT}"
        )
    return port


def replica_endpoint(host: str, scheduler_port: int, replica: int) -> str:
    """ZMQ endpoint of a replica's driver: ``tcp://host:(scheduler_port + replica)``."""
    if not host:
        raise LayoutError("host must be a non-empty string")
    port = _check_port(scheduler_port, replica)
    # ZMQ needs IPv6 literals bracketed, like URLs.
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}:{port}"


def replica_endpoints(host: str, scheduler_port: int, dp: int) -> list[str]:
    """Driver endpoints of replicas 0..dp-1, in replica order."""
    _check_positive_int("dp", dp)
    return [replica_endpoint(host, scheduler_port, r) for r in range(dp)]


def describe(config: ParallelConfig) -> str:
    """Compact layout string for logs and server_info, e.g. ``tp1-sp2(u2r1)-cfg2-dp3``."""
    c = config
    return f"tp{c.tp}-sp{c.sp}(u{c.ulysses}r{c.ring})-cfg{c.cfg}-dp{c.dp}"
