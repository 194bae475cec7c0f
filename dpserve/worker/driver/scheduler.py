"""The driver's scheduler: what the gang runs next, and what must stop.

The gang loop (worker/rank.py) takes a batch of compatible generations at a time
(worker/batch.py) or one other command, from :meth:`Scheduler.next_batch`. A
generation leaves the queue without running when its client cancels it or its
deadline passes: it is answered at once (or, for a deadline, within one poll of the
socket thread, which calls :meth:`Scheduler.tick`). A running one is found by
:meth:`Scheduler.halt`, which the gang asks at each denoising step: it answers a
request that must stop while others of its batch go on, and stops the gang when
none is left. Every answer leaves through the output path (worker/driver/outbox.py).
"""

from __future__ import annotations

import queue
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from dpserve.contract import protocol as p
from dpserve.worker.driver.outbox import Answer, Jobs, Outbox, Recipient
from dpserve.worker.driver.work_queue import Work, WorkQueue

if TYPE_CHECKING:
    from dpserve.worker.video_jobs import VideoBook

# A request that stops while others of its batch run on (Scheduler.halt).
_LEFT_BATCH = "dropped from its batch at a denoising step, the others went on"


class Scheduler:
    def __init__(
        self, replica: int, work: WorkQueue, outbox: Outbox, videos: VideoBook | None = None
    ) -> None:
        self.replica = replica
        self.work = work
        self.outbox = outbox
        self.videos = videos

    def enqueue(self, work: Work) -> None:
        """Queue ``work``, or refuse it when the queue is full."""
        try:
            self.work.put_nowait(work)
        except queue.Full:
            full = f"replica {self.replica} queue is full ({self.work.maxsize})"
            raise p.RequestError(p.OVERLOADED, full) from None

    # ------------------------------------------------------------ gang loop side

    def next_batch(self, timeout: float) -> list[Work]:
        """The next batch to run (one work, or compatible generations in queue order),
        which is the running one until :meth:`finished`; empty after ``timeout``.

        Work whose deadline passed since the socket thread last looked is answered
        here instead of run.
        """
        end = time.monotonic() + timeout
        while batch := self.work.start(max(0.0, end - time.monotonic())):
            now = time.monotonic()
            late = [(w, e) for w in batch if (e := _past_deadline(w, now, started=False))]
            for work, error in late:
                self.outbox.refuse(work.to, work.command.id, error)
            if len(late) < len(batch):
                for work in batch:
                    if isinstance(work.to, Jobs):
                        work.to.book.started(work.command.id)
                return self.work.discard([work for work, _ in late])
            self.work.finish()
        return []

    def halt(self) -> p.RequestError | None:
        """Why the running batch must stop now: every request in it was cancelled or
        passed its deadline. ``None``: go on.

        Asked by the gang loop at each denoising step. A request that must stop while
        others of its batch go on is answered here, at once, and its image is
        discarded when the batch ends. When all must stop, the last is left to the
        gang's own answer (the error returned here, raised on every rank).
        """
        now = time.monotonic()
        live = self.work.running()
        stopping = [(w, e) for w, cancelled in live if (e := _halt(w, cancelled, now))]
        if not stopping:
            return None
        last = stopping.pop()[1] if len(stopping) == len(live) else None
        for work, error in stopping:
            self.work.answered(work)
            dropped = p.RequestError(error.code, f"{error}; {_LEFT_BATCH}")
            self.outbox.refuse(work.to, work.command.id, dropped)
        return last

    def finished(self, answers: Sequence[Answer | None] = ()) -> None:
        """The running batch is done: ``answers`` holds each member's, in batch order
        (none for the driver's own commands), delivered unless it was answered already."""
        ended = self.work.finish()
        for (work, answered), answer in zip(ended, answers, strict=False):
            if answer and not answered:
                self.outbox.answer(work.to, answer)

    def refuse_all(self, error: p.RequestError) -> None:
        """Answer every queued work with ``error``: the gang takes no more."""
        while batch := self.next_batch(timeout=0):
            for work in batch:
                self.outbox.refuse(work.to, work.command.id, error)
            self.work.finish()

    # ------------------------------------------------------------ socket thread side

    def tick(self, now: float) -> None:
        """Answer queued work whose deadline passed (its client stopped waiting); keep
        the video job book within its bounds and stop the jobs past theirs."""
        for work in self.work.take(lambda w: w.deadline is not None and now >= w.deadline):
            late = _past_deadline(work, now, started=False)
            assert late is not None
            self.outbox.refuse(work.to, work.command.id, late)
        if self.videos is not None:
            self.videos.prune()
            for job_id in self.videos.overdue():  # past their run bound: stop at next step
                self.work.cancel(job_id, None)

    def cancel(self, request_id: str, to: Recipient | None, scope: str | None = None) -> str:
        """Cancel the generation ``request_id`` sent for ``to`` (None: for anyone) of
        ``scope``'s tenant (None: any): a queued one is answered now, a running one
        stops at its next step. Says where it was (protocol.CANCEL_*)."""
        taken, found = self.work.cancel(request_id, to, scope)
        for work in taken:
            gone = p.RequestError(
                p.CANCELLED, f"request {work.command.id} was cancelled before it started"
            )
            self.outbox.refuse(work.to, work.command.id, gone)
        return found


def _halt(work: Work, cancelled: bool, now: float) -> p.RequestError | None:
    """Why a running request must stop now (cancelled, or past its deadline), or None."""
    if cancelled:
        return p.RequestError(p.CANCELLED, f"request {work.command.id} was cancelled")
    return _past_deadline(work, now, started=True)


def _past_deadline(work: Work, now: float, started: bool) -> p.RequestError | None:
    if work.deadline is None or now < work.deadline:
        return None
    given = work.deadline - work.received_at
    where = "while it ran" if started else "before it started"
    return p.RequestError(
        p.DEADLINE_EXCEEDED,
        f"request {work.command.id} passed its deadline ({given:g}s after this replica "
        f"received it) {where}",
    )
