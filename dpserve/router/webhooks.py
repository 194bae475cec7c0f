"""Webhook events of video jobs (docs/webhooks.md): ``video.completed`` and
``video.failed``, signed the Standard Webhooks way, as OpenAI's own webhooks are.

**What.** The router that watches a job (dpserve/router/videos.py) hands each
terminal status it sees to :meth:`Webhooks.emit`, which never waits: the event goes
into a bounded queue (full: dropped, logged and counted) and a few sender tasks,
owned by the app's lifespan, deliver it. A slow or dead receiver holds up only those
senders, never a request or a job's watch.

**Once, at least.** An answer that is not 2xx, or none in time, is tried again after
a wait that doubles (capped at ``MAX_WAIT_S``) until ``retry_for_s`` after the event
was made; then it is given up (logged, counted). Every try is signed afresh (its own
``webhook-timestamp``: receivers refuse stale ones) but carries the same
``webhook-id`` and body: the id is derived from the job and the event type alone, so
a receiver drops repeats, whichever router sent them.

**Where to.** The URL is the router's configuration (``--webhook-url``), never a
request's: a client cannot make the router call an address of its choosing.
Redirects are not followed, for the same reason.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hashlib
import hmac
import json
import logging
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import httpx

from dpserve.config.router import default as option
from dpserve.contract import video

log = logging.getLogger(__name__)

COMPLETED: Final = "video.completed"
FAILED: Final = "video.failed"
EVENT_TYPES: Final = {video.COMPLETED: COMPLETED, video.FAILED: FAILED}
SECRET_PREFIX: Final = "whsec_"
# Standard Webhooks: a secret is 24 to 64 random bytes.
MIN_SECRET_BYTES, MAX_SECRET_BYTES = 24, 64
MAX_WAIT_S: Final = 60.0  # the longest wait between two tries
# Outcomes of an event (``dpserve_webhook_events_total{type,outcome}``).
DELIVERED, DROPPED, GIVEN_UP = "delivered", "dropped", "given_up"


def load_secret(path: Path) -> bytes:
    """The signing key of a Standard Webhooks secret file (``whsec_<base64>``, one
    line); ValueError naming what is wrong (never the secret)."""
    try:
        text = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read the webhook secret file {path}: {exc}") from None
    if not text.startswith(SECRET_PREFIX):
        raise ValueError(
            f"the webhook secret file {path} does not hold a Standard Webhooks secret: "
            f"write one line 'whsec_' followed by {MIN_SECRET_BYTES}-{MAX_SECRET_BYTES} "
            'random bytes in base64 (e.g. python -c "import base64,os; '
            "print('whsec_'+base64.b64encode(os.urandom(32)).decode())\")"
        )
    try:
        key = base64.b64decode(text.removeprefix(SECRET_PREFIX), validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(
            f"the webhook secret in {path} is not valid base64 after 'whsec_'"
        ) from None
    if not MIN_SECRET_BYTES <= len(key) <= MAX_SECRET_BYTES:
        raise ValueError(
            f"the webhook secret in {path} is {len(key)} bytes; a Standard Webhooks "
            f"secret is {MIN_SECRET_BYTES} to {MAX_SECRET_BYTES} random bytes"
        )
    return key


def check_url(url: str) -> str:
    """An http(s) URL with a host and no credentials (they would show in logs and
    errors; a receiver checks the signature instead); ValueError otherwise."""
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 - a bad port raises here
    except ValueError as exc:
        raise ValueError(f"the webhook URL {url[:200]!r} is not a URL: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"the webhook URL {url[:200]!r} is not http(s)://HOST[:PORT]/PATH")
    if parts.username is not None or parts.password is not None:
        raise ValueError(
            "the webhook URL carries credentials (user:password@); leave them out: "
            "receivers verify the webhook-signature header instead"
        )
    if parts.fragment:
        raise ValueError(f"the webhook URL {url[:200]!r} has a #fragment; leave it out")
    return url


def event_id(job_id: str, event_type: str) -> str:
    """The same for every router and every try: receivers drop repeats by it."""
    digest = hashlib.sha256(f"{event_type}\n{job_id}".encode()).hexdigest()
    return f"evt_{digest[:32]}"


def sign(key: bytes, msg_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` header: HMAC-SHA256 of ``{id}.{timestamp}.{body}``."""
    signed = f"{msg_id}.{timestamp}.".encode() + body
    digest = hmac.new(key, signed, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


@dataclass(frozen=True)
class Event:
    id: str
    type: str
    body: bytes  # the same bytes on every try
    tenant: str  # whose job (logs only: receivers are the operator's, not a tenant's)
    made_at: float = field(default_factory=time.monotonic)
    # Called once the event ends (delivered, given up or dropped): the job's record
    # stops waiting for it (dpserve/router/videos.py, "Tell").
    done: Callable[[], None] = field(default=lambda: None, compare=False)


def job_event(job: video.VideoJob, done: Callable[[], None] = lambda: None) -> Event | None:
    """The event of a job's terminal status; None for one that has none (cancelled)."""
    event_type = EVENT_TYPES.get(job.status)
    if event_type is None:
        return None
    eid = event_id(job.id, event_type)
    body = {
        "id": eid,
        "object": "event",
        "type": event_type,
        # When the job finished: every router that sends it sends the same body.
        "created_at": job.completed_at or int(time.time()),
        "data": {"id": job.id},
    }
    data = json.dumps(body, separators=(",", ":")).encode()
    return Event(eid, event_type, data, job.tenant, done=done)


@dataclass(frozen=True)
class WebhookSettings:
    url: str
    key: bytes = field(repr=False)  # the secret, decoded
    retry_for_s: float = option("webhook_retry_for")
    first_wait_s: float = 1.0  # before the second try; doubles after each
    attempt_timeout_s: float = 10.0
    queue: int = 1000  # events waiting for a sender, then dropped
    senders: int = 4  # receivers answered at once


class Webhooks:
    """The event queue and its senders; :meth:`start` and :meth:`close` are the
    lifespan's. ``count(type, outcome)`` counts each event's end."""

    def __init__(self, settings: WebhookSettings, count: Callable[[str, str], None]) -> None:
        self.settings = settings
        self._count = count
        self._queue: asyncio.Queue[Event] = asyncio.Queue(settings.queue)
        self._tasks: list[asyncio.Task[None]] = []
        self._http: httpx.AsyncClient | None = None

    @property
    def waiting(self) -> int:
        """Events queued for a sender."""
        return self._queue.qsize()

    def start(self) -> None:
        self._http = httpx.AsyncClient(
            timeout=self.settings.attempt_timeout_s, follow_redirects=False
        )
        self._tasks = [
            asyncio.create_task(self._send_forever(), name=f"webhook sender {i}")
            for i in range(self.settings.senders)
        ]

    async def close(self) -> None:
        """Stop sending; events not delivered yet are not (docs/webhooks.md)."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._http is not None:
            await self._http.aclose()
        if not self._queue.empty():
            log.warning("webhooks: %d events were not sent (shutting down)", self._queue.qsize())

    def emit(self, job: video.VideoJob, done: Callable[[], None] = lambda: None) -> None:
        """Queue the event of a job's terminal status, if it has one; never waits.
        ``done`` is called once the event ends (at once when there is none)."""
        event = job_event(job, done)
        if event is None:
            done()
            return
        try:
            self._queue.put_nowait(event)
        except asyncio.QueueFull:
            log.error(
                "webhook %s of %s is dropped: %d events already wait for the receiver",
                event.type,
                job.id,
                self._queue.qsize(),
            )
            self._count(event.type, DROPPED)
            done()

    async def _send_forever(self) -> None:
        while True:
            event = await self._queue.get()
            try:
                delivered = await self._deliver(event)
            except Exception:  # a bug here must not stop the sender
                log.exception("webhook %s failed", event.id)
                delivered = False
            self._count(event.type, DELIVERED if delivered else GIVEN_UP)
            event.done()

    async def _deliver(self, event: Event) -> bool:
        """Try until a 2xx, or past the time bound."""
        assert self._http is not None
        s = self.settings
        wait, tries = s.first_wait_s, 0
        while True:
            tries += 1
            why = await self._try(event)
            if why is None:
                return True
            spent = time.monotonic() - event.made_at
            if spent + wait > s.retry_for_s:
                log.error(
                    "webhook %s (%s) is given up after %d tries in %.0f s: %s",
                    event.id,
                    event.type,
                    tries,
                    spent,
                    why,
                )
                return False
            log.warning("webhook %s try %d: %s; again in %.1f s", event.id, tries, why, wait)
            await asyncio.sleep(wait)
            wait = min(wait * 2, MAX_WAIT_S)

    async def _try(self, event: Event) -> str | None:
        """One signed POST; None when delivered, else why not."""
        assert self._http is not None
        now = int(time.time())
        headers = {
            "content-type": "application/json",
            "user-agent": "dpserve-webhooks",
            "webhook-id": event.id,
            "webhook-timestamp": str(now),
            "webhook-signature": sign(self.settings.key, event.id, now, event.body),
        }
        try:
            answer = await self._http.post(self.settings.url, content=event.body, headers=headers)
        except httpx.HTTPError as exc:
            return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        if 200 <= answer.status_code < 300:
            log.info("webhook %s (%s) delivered", event.id, event.type)
            return None
        return f"the receiver answered {answer.status_code}"
