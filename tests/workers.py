"""Test helpers over real worker processes."""

from __future__ import annotations

import time

import psutil

from dpserve.client import ReplicaClient
from dpserve.local import WorkerProcess
from dpserve.plumbing.ports import free_port

__all__ = ["WorkerProcess", "free_port", "ranks", "until_denoising"]


def ranks(worker: WorkerProcess) -> list[psutil.Process]:
    """The gang's rank processes, driver (rank 0) first; spawn's helpers excluded."""
    children = psutil.Process(worker.proc.pid).children()
    found = [
        c
        for c in children
        if "spawn_main" in " ".join(c.cmdline()) and "resource_tracker" not in " ".join(c.cmdline())
    ]
    return sorted(found, key=lambda c: (c.create_time(), c.pid))


def until_denoising(pinger: ReplicaClient, timeout_s: float = 30) -> None:
    """Until the gang is in the denoising loop of the work it took next: a denoiser
    call's progress tick is newer than the first ping that found the gang busy.

    Call it once the gang's previous work was answered (its ``busy`` is then off).
    The gang loop ticks progress before it takes work and marks itself busy after,
    so a tick after busy was seen is a denoiser call's. A ping's ``progress_age_s``
    is measured on the driver after the ping was sent: sent minus age is at or
    before the tick (to its 1 ms rounding).
    """
    deadline = time.monotonic() + timeout_s
    busy_seen: float | None = None
    while True:
        sent = time.monotonic()
        ping = pinger.ping()
        if ping.busy and busy_seen is None:
            busy_seen = time.monotonic()
        elif ping.busy and busy_seen is not None and sent - ping.progress_age_s > busy_seen + 0.001:
            return
        assert time.monotonic() < deadline, "the gang never reached a denoising step"
        time.sleep(0.01)
