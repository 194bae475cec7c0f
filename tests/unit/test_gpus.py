"""One GPU per rank of a gang, and replicas' own blocks of GPUs (pure parts)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dpserve.local import ReplicaSetConfig
from dpserve.worker.gpus import gang_first_gpu, gpu_problem


@pytest.mark.parametrize(
    ("device", "gang", "visible", "needle"),
    [
        ("cpu", 4, 0, None),
        ("auto", 2, 0, None),  # no GPU: auto means CPU
        ("auto", 2, 2, None),
        ("cuda", 1, 0, "no CUDA device is visible"),
        ("cuda", 2, 1, "a gang of 2 ranks needs 2 GPUs (one per rank) but 1 are visible"),
        ("auto", 4, 2, "needs 4 GPUs"),
    ],
)
def test_a_gang_needs_one_gpu_per_rank(
    device: str, gang: int, visible: int, needle: str | None
) -> None:
    problem = gpu_problem(device, gang, visible)
    assert problem is None if needle is None else (problem is not None and needle in problem)


def test_replicas_take_their_own_blocks_then_share() -> None:
    # 4 GPUs, gangs of 2: replicas 0 and 1 own GPUs 0-1 and 2-3; replica 2 wraps to 0-1.
    assert [gang_first_gpu(r * 2, 2, 4) for r in range(4)] == [0, 2, 0, 2]
    # One GPU, single-rank replicas (the seed's dp=2 on one card): both on GPU 0.
    assert [gang_first_gpu(r, 1, 1) for r in range(2)] == [0, 0]
    # A pod sees only its own GPUs and always starts at 0.
    assert gang_first_gpu(0, 2, 2) == 0


def test_serve_gives_each_replica_its_block() -> None:
    config = ReplicaSetConfig(Path("/m"), 3, 5575, ("--cfg", "2"), gang_size=2)
    flags = [config.replica_args(r) for r in range(3)]
    assert [f[f.index("--first-gpu") + 1] for f in flags] == ["0", "2", "4"]
    assert [f[f.index("--replica") + 1] for f in flags] == ["0", "1", "2"]
    assert all(f[:2] == ("--cfg", "2") for f in flags)
