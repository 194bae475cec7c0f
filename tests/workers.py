"""Test helpers over real worker processes."""

from __future__ import annotations

import time

import psutil

from dpserve.client import ReplicaClient
from dpserve.local import WorkerProcess
from dpserve.plumbing.ports import free_port
from dpserve.plumbing.proc import RANK_PROCESS_PREFIX

__all__ = ["WorkerProcess", "free_port", "gang_ranks", "ranks", "until_denoising"]


def ranks(worker: WorkerProcess) -> list[psutil.Process]:
    """The gang's rank processes, driver (rank 0) first."""
    return gang_ranks(psutil.Process(worker.proc.pid))


def gang_ranks(supervisor: psutil.Process) -> list[psutil.Process]:
    """A supervisor's ranks, by the name each rank gives its process (spawned ones are
    its children, a CPU gang's forked ones its fork server's), rank 0 first."""
    found = []
    for child in supervisor.children(recursive=True):
        try:
            name = child.name()
        except psutil.NoSuchProcess:
            continue
        if name.startswith(RANK_PROCESS_PREFIX):
            found.append((int(name.removeprefix(RANK_PROCESS_PREFIX)), child))
    return [proc for _, proc in sorted(found, key=lambda found: found[0])]


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
