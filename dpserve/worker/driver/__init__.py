"""The driver: the first rank's front to its replica, in parts with one owner each.

The shape is an engine core's: an input thread, a scheduler, an output path.

- :mod:`~dpserve.worker.driver.socket_thread`: the thread that owns the ZMQ ROUTER
  socket: receives, decodes envelopes, sends answers (its own and, over an inproc
  pair, everyone else's).
- :mod:`~dpserve.worker.driver.admission`: turns each decoded request into queued
  work or an immediate answer (validation against the limits and what the model
  serves, draining, session and queue capacity, pings, cancels);
  :mod:`~dpserve.worker.driver.video_desk` answers a video model's job actions.
- :mod:`~dpserve.worker.driver.work_queue` holds the queue and the running batch;
  :mod:`~dpserve.worker.driver.scheduler` is what the gang loop talks to: the next
  batch, whether it must stop (cancels, deadlines), its answers.
- :mod:`~dpserve.worker.driver.outbox`: the output path; work names who gets its
  answers, a client (frames, through the socket thread) or the video job book (the
  gang's answer as values).

:class:`Driver` builds and wires them, and closes them in order.
"""

from __future__ import annotations

import threading
import uuid
from typing import TYPE_CHECKING

from dpserve.contract import protocol as p
from dpserve.contract import validation as pv
from dpserve.worker.batch import Batching
from dpserve.worker.commands import GangStatus
from dpserve.worker.driver.admission import Admission
from dpserve.worker.driver.outbox import Outbox
from dpserve.worker.driver.scheduler import Scheduler
from dpserve.worker.driver.socket_thread import SocketThread
from dpserve.worker.driver.video_desk import VideoDesk
from dpserve.worker.driver.work_queue import WorkQueue

if TYPE_CHECKING:
    from dpserve.plumbing.curve import WireKey
    from dpserve.worker.driver.read_ahead import ReadAhead
    from dpserve.worker.features import Features
    from dpserve.worker.video_jobs import VideoBook


class Driver:
    def __init__(
        self,
        endpoint: str,
        replica: int,
        limits: pv.Limits,
        status: GangStatus,
        max_queue: int,
        stall_s: float,
        max_sessions: int,
        *,
        settle: bool = False,
        key: WireKey | None = None,
        features: Features | None = None,
        batching: Batching | None = None,
        videos: VideoBook | None = None,
        read_ahead: ReadAhead | None = None,
    ) -> None:
        """``key``: the service's wire key (None: a plaintext wire). ``features``: what
        the model serves (None: not known here). ``batching``: how generations gather
        into batches (None: one at a time). ``videos``: the job book of a video model
        (None: the model makes no videos). ``read_ahead``: reads the files of adapters
        queued requests name (None: none)."""
        self.read_ahead = read_ahead
        self.replica = replica
        self.status = status
        self.videos = videos
        self.draining = threading.Event()  # set by the gang loop: take nothing new
        self.socket = SocketThread(endpoint, replica, settle=settle, key=key)
        self.endpoint = self.socket.endpoint
        self.outbox = Outbox(self.socket.send)
        self.scheduler = Scheduler(replica, WorkQueue(max_queue, batching), self.outbox, videos)
        desk = None
        if videos is not None:
            desk = VideoDesk(
                videos, replica, limits, status, self.scheduler, self.draining, features
            )
        self.admission = Admission(
            replica,
            limits,
            status,
            self.scheduler,
            self.draining,
            stall_s=stall_s,
            max_sessions=max_sessions,
            boot_id=uuid.uuid4().hex,
            features=features,
            videos=desk,
            read_ahead=read_ahead,
        )

    def start(self) -> None:
        if self.read_ahead is not None:
            self.read_ahead.start()
        self.socket.start(self.admission.handle, self.scheduler.tick)

    def close(self) -> None:
        # Work that slipped in after the loop's last look is refused, not lost silently.
        self.scheduler.refuse_all(
            p.RequestError(p.UNAVAILABLE, f"replica {self.replica} is shutting down")
        )
        self.socket.close()
        if self.read_ahead is not None:
            self.read_ahead.close()
        if self.videos is not None:
            self.videos.close()
