"""One image request as a task the registry can find: started, awaited, or streamed.

The handler admits the id (409 if it is in flight), starts the service's call as a
task and registers it; a cancel by id cancels that task, wherever the request is,
and its caller then gets ``cancelled`` (499), as a client that left would.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from dpserve.contract import protocol as p
from dpserve.contract import validation as pv
from dpserve.router.openai_api import INTERNAL_MESSAGE, error_body
from dpserve.router.registry import CANCELLED, COMPLETED, FAILED, InFlight, Registry
from dpserve.router.service import Generated, RouterService
from dpserve.router.streaming import completed_events, error_event, partial_event
from dpserve.router.tenants import KEYLESS
from dpserve.router.usage import Work

log = logging.getLogger(__name__)
CANCELLED_MESSAGE = "the request was cancelled (POST /v1/images/{id}/cancel)"


@dataclass
class Job:
    entry: InFlight
    task: asyncio.Future[Generated]
    previews: asyncio.Queue[p.Message] | None = None


def start(
    registry: Registry,
    service: RouterService,
    request_id: str,
    params: p.GenerateParams,
    blobs: list[bytes] | None = None,
    meter: Callable[[Work], None] | None = None,
    tenant: str = KEYLESS.tenant,
) -> Job:
    """``meter`` counts what the request made once a replica answered it (its tenant's
    usage, its route's histograms); ``tenant`` owns the request (who may cancel it)."""
    entry = registry.admit(request_id, tenant)
    previews: asyncio.Queue[p.Message] | None = None
    on_partial: Callable[[p.Message], None] | None = None
    if params.partial_images:
        # At most this many come (a retry may send them again: the oldest stay).
        previews = asyncio.Queue(maxsize=params.n * pv.MAX_PARTIAL_IMAGES)

        def on_partial(message: p.Message) -> None:
            assert previews is not None
            if not previews.full():
                previews.put_nowait(message)

    task = asyncio.ensure_future(
        service.generate(
            params, request_id, blobs, on_partial=on_partial, stage=entry, tenant=tenant
        )
    )
    entry.task = task
    task.add_done_callback(lambda t: registry.finish(entry, _outcome(t)))
    if meter is not None:
        task.add_done_callback(lambda t: _count(t, meter))
    return Job(entry, task, previews)


def _count(task: asyncio.Future[Generated], meter: Callable[[Work], None]) -> None:
    if task.cancelled() or task.exception() is not None:
        return
    done = task.result()
    result = done.result
    queued = done.waited_s + result.queue_time_s
    meter(Work(len(done.images), 0, done.units, result.inference_time_s, queued))


def _outcome(task: asyncio.Future[Generated]) -> str:
    if task.cancelled():
        return CANCELLED
    exc = task.exception()
    if exc is None:
        return COMPLETED
    return CANCELLED if isinstance(exc, p.RequestError) and exc.code == p.CANCELLED else FAILED


async def result(
    job: Job, wait: Callable[[Awaitable[Generated]], Awaitable[Generated]]
) -> Generated:
    """The job's answer through ``wait`` (which may give up: the client left); a cancel by
    id is the ``cancelled`` error."""
    try:
        return await wait(job.task)
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if job.entry.cancelled and job.task.cancelled() and not (current and current.cancelling()):
            raise p.RequestError(p.CANCELLED, CANCELLED_MESSAGE) from None
        raise
    finally:
        if not job.task.done():
            job.task.cancel()


async def events(job: Job, kind: str) -> AsyncIterator[dict[str, Any]]:
    """The job as stream events: previews as they come, then one completed event per
    image, or an ``error`` event. Closing the stream (the client left) cancels the job."""
    rid = job.entry.request_id
    try:
        while job.previews is not None:
            preview = asyncio.ensure_future(job.previews.get())
            waits: set[asyncio.Future[Any]] = {preview, job.task}
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            if not preview.done():
                preview.cancel()
                break
            if (event := _preview(kind, rid, preview.result())) is not None:
                yield event
        while job.previews is not None and not job.previews.empty():
            if (event := _preview(kind, rid, job.previews.get_nowait())) is not None:
                yield event
        try:
            done = await job.task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise
            yield error_event(rid, error_body(499, CANCELLED_MESSAGE))
            return
        except p.RequestError as exc:
            yield error_event(rid, error_body(exc.status, str(exc), exc.fields, code=exc.code))
            return
        except Exception:  # still a bug, logged; the stream ends in the error shape
            log.exception("image stream %s failed", rid)
            yield error_event(rid, error_body(500, INTERNAL_MESSAGE))
            return
        for event in completed_events(kind, rid, done.result, done.images):
            yield event
    finally:
        if not job.task.done():
            job.task.cancel()


def _preview(kind: str, request_id: str, message: p.Message) -> dict[str, Any] | None:
    """A preview's event; an unreadable one is skipped (the final image still comes)."""
    try:
        return partial_event(kind, request_id, message)
    except (p.ProtocolError, IndexError) as exc:
        log.warning("dropping an unreadable preview of %s: %s", request_id, exc)
        return None
