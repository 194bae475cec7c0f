"""The gang's process groups (built from the layout) and byte relays over its CPU group.

Requests and control results cross the gang as raw bytes (msgpack) in uint8
tensors over a gloo group, so the relay works the same under NCCL and needs no
pickle.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from dpserve.contract.layout import Axis, ParallelConfig, RankInfo, all_groups, rank_info
from dpserve.worker.parallel import ParallelGroups


@dataclass
class GangComm:
    info: RankInfo
    cpu_group: dist.ProcessGroup
    cfg_group: dist.ProcessGroup | None
    model_groups: ParallelGroups = field(default_factory=ParallelGroups)

    @property
    def size(self) -> int:
        return len(self.info.replica_group)

    def broadcast_bytes(self, payload: bytes | None) -> bytes:
        """The driver's ``payload`` on every rank (others pass ``None``)."""
        src = self.info.replica_group[0]
        size = torch.tensor([len(payload) if payload is not None else 0], dtype=torch.int64)
        dist.broadcast(size, src=src, group=self.cpu_group)
        length = int(size.item())
        if length == 0:
            return b""
        if self.info.is_driver:
            assert payload is not None
            buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        else:
            buf = torch.empty(length, dtype=torch.uint8)
        dist.broadcast(buf, src=src, group=self.cpu_group)
        return payload if payload is not None else buf.numpy().tobytes()

    def gather_bytes(self, payload: bytes) -> list[bytes]:
        """Every rank's ``payload``, in rank order, on every rank."""
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        dist.all_gather(sizes, torch.tensor([len(payload)], dtype=torch.int64), self.cpu_group)
        longest = max(int(s.item()) for s in sizes)
        if longest == 0:
            return [b""] * self.size
        mine = torch.zeros(longest, dtype=torch.uint8)
        if payload:
            mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        bufs = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.size)]
        dist.all_gather(bufs, mine, self.cpu_group)
        return [b.numpy()[: int(s.item())].tobytes() for b, s in zip(bufs, sizes, strict=True)]


def init_gang(
    layout: ParallelConfig,
    rank: int,
    store_path: str,
    device: torch.device,
    timeout_s: float,
    backend: str | None = None,
) -> GangComm:
    """Join the gang's process group and create every subgroup in the layout's order.

    The backend is NCCL on CUDA and gloo on CPU; ``backend`` overrides it (gloo for
    ranks that share one GPU, which NCCL refuses: a correctness check, not a mode).
    """
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    dist.init_process_group(
        backend=backend,
        init_method=f"file://{store_path}",
        world_size=layout.gang_size,
        rank=rank,
        timeout=timedelta(seconds=timeout_s),
    )
    info = rank_info(layout, rank)
    cpu_group = dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo")
    assert isinstance(cpu_group, dist.ProcessGroup)
    mine: dict[Axis, dist.ProcessGroup | None] = {}
    for axis in _SPLIT_AXES:
        mine[axis] = _own_group(layout, axis, rank, backend)
    lent = _lent_groups(layout, rank, backend)
    groups = ParallelGroups(
        tp=mine["tp"],
        sp=mine["sp"],
        ulysses=mine["ulysses"],
        ring=mine["ring"],
        lent_sp=lent[0][0],
        lent_ulysses=lent[1][0],
        lent_ring=lent[2][0],
        lent_ring_ranks=lent[2][1],
    )
    return GangComm(info=info, cpu_group=cpu_group, cfg_group=mine["cfg"], model_groups=groups)


Owned = tuple[dist.ProcessGroup | None, tuple[int, ...]]


def _lent_groups(layout: ParallelConfig, rank: int, backend: str) -> list[Owned]:
    """A CFG gang's groups for requests without true CFG, with this rank's members: the
    sp ranks of both CFG branches (same tp rank), their Ulysses ranks (same tp and ring
    rank) and their ring ranks (same tp and Ulysses rank).

    In ascending rank order a rank's index is ``sp_rank + sp * cfg_rank``,
    ``ulysses_rank + ulysses * cfg_rank`` and ``ring_rank + ring * cfg_rank``.
    """
    if layout.cfg < 2:
        return [(None, ())] * 3
    t, u, g = layout.tp, layout.ulysses, layout.gang_size
    ranks = range(g)
    tps, uls, rings = range(t), range(u), range(layout.ring)
    sets = [
        [tuple(r for r in ranks if r % t == a) for a in tps],
        [tuple(r for r in ranks if r % t == a and r // (t * u) % layout.ring == b)
         for a in tps for b in rings],
        [tuple(r for r in ranks if r % t == a and r // t % u == b) for a in tps for b in uls],
    ]  # fmt: skip
    found: list[Owned] = []
    for members in sets:
        own: Owned = (None, ())
        for group_ranks in members:  # every rank creates every group, in the same order
            group = dist.new_group(list(group_ranks), backend=backend)
            if rank in group_ranks and isinstance(group, dist.ProcessGroup):
                own = (group, group_ranks)
        found.append(own)
    return found


# The order in which every rank creates the groups of each axis.
_SPLIT_AXES: tuple[Axis, ...] = ("tp", "sp", "ulysses", "ring", "cfg")


def _own_group(
    layout: ParallelConfig, axis: Axis, rank: int, backend: str
) -> dist.ProcessGroup | None:
    """This rank's group along ``axis`` (None for degree 1).

    Every rank creates every group, in the same order, members or not.
    """
    degree = {"tp": layout.tp, "sp": layout.sp, "ulysses": layout.ulysses, "ring": layout.ring}
    if degree.get(axis, layout.cfg) < 2:
        return None
    own: dist.ProcessGroup | None = None
    for ranks in all_groups(layout, axis):
        group = dist.new_group(list(ranks), backend=backend)
        if rank in ranks and isinstance(group, dist.ProcessGroup):
            own = group
    return own
