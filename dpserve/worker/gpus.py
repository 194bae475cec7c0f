"""Which GPUs a gang's ranks take: one each, checked before any rank starts."""

from __future__ import annotations


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
