"""The gang's bounded FIFO and the batch it runs now: the work queue's state alone.

What happens to work that leaves it early (cancelled, past its deadline) is the
scheduler's (worker/driver/scheduler.py); this file only keeps every piece of work
in exactly one place.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from dpserve.contract import protocol as p
from dpserve.contract.owners import may_see
from dpserve.worker.batch import Batching
from dpserve.worker.commands import GangCommand
from dpserve.worker.driver.outbox import Recipient


@dataclass(frozen=True)
class Work:
    to: Recipient  # who gets its answers: a client, or the video job book
    command: GangCommand
    received_at: float
    deadline: float | None = None  # on the driver's monotonic clock; generations only
    tenant: str = ""  # whose request it is (the header's): a scoped cancel reaches its own only


@dataclass(eq=False)
class _Running:
    """A member of the running batch."""

    work: Work
    cancelled: bool = False  # its client cancelled it
    answered: bool = False  # dropped from its batch, and answered already


class WorkQueue:
    """The gang's bounded FIFO, and the batch the gang runs now (one work, or several
    compatible generations: worker/batch.py).

    A generation may leave the queue before its turn (cancelled, or past its
    deadline), and a batch before the batch ends. One lock covers the queue and the
    running batch, so a cancel finds a request in exactly one of the two places, or
    nowhere (done already).
    """

    def __init__(self, maxsize: int, batching: Batching | None = None) -> None:
        self.maxsize = maxsize
        self.batching = batching or Batching()
        self._items: deque[Work] = deque()
        self._cond = threading.Condition()  # reentrant
        self._running: list[_Running] = []

    def qsize(self) -> int:
        return len(self._items)

    def put_nowait(self, work: Work) -> None:
        with self._cond:
            if len(self._items) >= self.maxsize:
                raise queue.Full
            self._items.append(work)
            self._cond.notify()

    def start(self, timeout: float) -> list[Work]:
        """The next batch, which becomes the running one; empty after ``timeout``.

        The oldest work, and the compatible generations that may join it. A batch
        with nothing compatible queued behind its first request starts at once; one
        that gathered more but is not full waits up to ``batching.wait_s`` for more
        (its members count as running meanwhile: a cancel reaches them).
        """
        with self._cond:
            self._cond.wait_for(lambda: bool(self._items), timeout)
            self._running = []
            if not self._items:
                return []
            self._running.append(_Running(self._items.popleft()))
            if self.batching.grows(self._running[0].work.command):
                self._gather(time.monotonic() + self.batching.wait_s)
            return [member.work for member in self._running]

    def _gather(self, until: float) -> None:
        while True:
            batch = [member.work.command for member in self._running]
            taken, barrier = self.batching.joiners(batch, [w.command for w in self._items])
            chosen = set(taken)
            self._running += [_Running(w) for i, w in enumerate(self._items) if i in chosen]
            self._items = deque(w for i, w in enumerate(self._items) if i not in chosen)
            left = until - time.monotonic()
            alone = len(self._running) == 1  # nothing compatible queued: no reason to wait
            full = self.batching.full([member.work.command for member in self._running])
            if alone or full or barrier or left <= 0:
                return
            self._cond.wait(left)  # until new work arrives (put_nowait notifies)

    def discard(self, works: list[Work]) -> list[Work]:
        """Take ``works`` out of the running batch before it runs; the batch left."""
        with self._cond:
            self._running = [m for m in self._running if all(m.work is not w for w in works)]
            return [member.work for member in self._running]

    def finish(self) -> list[tuple[Work, bool]]:
        """The batch ended: its members, each with whether it was answered already."""
        with self._cond:
            ended = [(member.work, member.answered) for member in self._running]
            self._running = []
            return ended

    def running(self) -> list[tuple[Work, bool]]:
        """The running batch's members not answered yet, each with whether its client
        cancelled it."""
        with self._cond:
            return [(m.work, m.cancelled) for m in self._running if not m.answered]

    def answered(self, work: Work) -> None:
        """``work`` left its running batch with an answer; the others go on."""
        with self._cond:
            for member in self._running:
                if member.work is work:
                    member.answered = True

    def snapshot(self) -> list[Work]:
        """The work running (not answered yet) and queued, in that order."""
        with self._cond:
            running = [m.work for m in self._running if not m.answered]
            return running + list(self._items)

    def take(self, drop: Callable[[Work], bool]) -> list[Work]:
        """Remove the queued work ``drop`` picks, and return it in queue order."""
        with self._cond:
            kept: deque[Work] = deque()
            taken: list[Work] = []
            for work in self._items:
                (taken if drop(work) else kept).append(work)
            self._items = kept
            return taken

    def cancel(
        self, request_id: str, to: Recipient | None, scope: str | None = None
    ) -> tuple[list[Work], str]:
        """The generation ``request_id`` sent for ``to`` (None: for anyone) of ``scope``'s
        tenant (None: any; dpserve/contract/owners.py): removed if queued (and
        returned), marked if running; anything else is left alone. Also says where it
        was (protocol.CANCEL_*)."""

        def named(work: Work) -> bool:
            command = work.command
            return (
                (to is None or work.to == to)
                and may_see(scope, work.tenant)
                and command.id == request_id
                and command.kind == p.GENERATE
            )

        with self._cond:
            running = False
            for member in self._running:
                if not member.answered and named(member.work):
                    member.cancelled = running = True
            taken = self.take(named)
        found = p.CANCEL_QUEUED if taken else p.CANCEL_RUNNING if running else p.CANCEL_NOT_FOUND
        return taken, found
