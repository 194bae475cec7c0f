"""Test helpers over real worker processes."""

from __future__ import annotations

import psutil

from dpserve.local import WorkerProcess
from dpserve.plumbing.ports import free_port

__all__ = ["WorkerProcess", "free_port", "ranks"]


def ranks(worker: WorkerProcess) -> list[psutil.Process]:
    """The gang's rank processes, driver (rank 0) first; spawn's helpers excluded."""
    children = psutil.Process(worker.proc.pid).children()
    found = [
        c
        for c in children
        if "spawn_main" in " ".join(c.cmdline()) and "resource_tracker" not in " ".join(c.cmdline())
    ]
    return sorted(found, key=lambda c: (c.create_time(), c.pid))
