"""The driver's output path: every answer to queued work leaves through here.

A piece of work names who gets its answers (:data:`Recipient`): the client whose
request it is, or the replica's video job book. A client gets wire frames through
the socket thread (worker/driver/socket_thread.py); the job book gets the gang's
answer as the values it is (worker/reply.py), never frames to decode again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dpserve.contract import protocol as p
from dpserve.worker.reply import Reply

if TYPE_CHECKING:
    from dpserve.worker.video_jobs import VideoBook

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Client:
    """A peer of the ROUTER socket, by the identity ZMQ gave it."""

    identity: bytes


@dataclass(frozen=True, eq=False)
class Jobs:
    """The video job book: a job's generation reports to its record."""

    book: VideoBook


Recipient = Client | Jobs
# A generation's reply as values, or the frames of a session's or a control op's
# answer (the executor encodes those; they only ever go to a client).
Answer = Reply | list[bytes]
Send = Callable[[bytes, list[bytes]], None]  # identity, frames: the socket thread's


class Outbox:
    def __init__(self, send: Send) -> None:
        self._send = send

    def answer(self, to: Recipient, answer: Answer) -> None:
        """Deliver ``answer``; safe from any thread (the socket thread's ``send`` is)."""
        if isinstance(to, Client):
            frames = answer.frames() if isinstance(answer, Reply) else answer
            self._send(to.identity, frames)
        elif isinstance(answer, Reply):
            to.book.answer(answer)
        else:  # never: only generations run for the book
            log.error("dropping an encoded answer meant for the video job book")

    def refuse(self, to: Recipient, request_id: str, error: p.RequestError) -> None:
        self.answer(to, Reply.error(request_id, error))
