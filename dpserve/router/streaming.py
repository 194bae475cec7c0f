"""Streamed image answers: OpenAI's image streaming events over Server-Sent Events.

Events are pure builders (``partial_event``, ``completed_event``, ``error_event``);
``EventStream`` is the ASGI response that sends them and, whatever the server's ASGI
version, notices the client leaving while nothing is being sent (then the work is
cancelled, which cancels it at the replica). Previews reach it through a queue the
connection's reader fills without waiting: a client that stops reading stalls only
its own stream, and the queue holds at most a request's previews.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any, Final

from starlette.responses import StreamingResponse

from dpserve.contract import protocol as p
from dpserve.router.openai_api import BACKGROUND, NO_USAGE, size_of

MEDIA_TYPE: Final = "text/event-stream"
_NO_CACHE: Final = {"cache-control": "no-cache", "x-accel-buffering": "no"}
GENERATION, EDIT = "image_generation", "image_edit"


def _common(request_id: str, blob: bytes, fmt: str, width: int, height: int) -> dict[str, Any]:
    return {
        "id": request_id,
        "b64_json": base64.b64encode(blob).decode(),
        "created_at": int(time.time()),
        "size": size_of(width, height),
        "quality": "auto",
        "background": BACKGROUND,
        "output_format": fmt,
    }


def partial_event(kind: str, request_id: str, message: p.Message) -> dict[str, Any]:
    preview: p.PartialImage = message.body_as(p.PartialImage)
    blob = message.blobs[preview.blob]
    return {
        "type": f"{kind}.partial_image",
        **_common(request_id, blob, preview.format, preview.width, preview.height),
        "partial_image_index": preview.index,
        "image_index": preview.image,
        "step": preview.step,
        "steps": preview.steps,
    }


def completed_events(
    kind: str, request_id: str, result: p.GenerateResult, images: list[bytes]
) -> list[dict[str, Any]]:
    return [
        {
            "type": f"{kind}.completed",
            **_common(request_id, images[i], meta.format, meta.width, meta.height),
            "usage": NO_USAGE,
            "image_index": meta.index,
            "seed": meta.seed,
            "inference_time_s": result.inference_time_s,
            "encode_time_s": result.encode_time_s,
        }
        for i, meta in enumerate(result.images)
    ]


def error_event(request_id: str, error: dict[str, Any]) -> dict[str, Any]:
    """``error``: OpenAI's error body (the openai client raises it as an APIError)."""
    return {"type": "error", "id": request_id, **error}


def encode_event(event: dict[str, Any]) -> bytes:
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()


class EventStream(StreamingResponse):
    """An ASGI response sending ``events``; a client that leaves cancels them."""

    def __init__(self, events: AsyncIterator[dict[str, Any]]) -> None:
        super().__init__(_encoded(events), media_type=MEDIA_TYPE, headers=_NO_CACHE)
        self.events = events

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        start = {"type": "http.response.start", "status": 200, "headers": self.raw_headers}
        await send(start)
        sending = asyncio.ensure_future(self._send_all(send))
        gone = asyncio.ensure_future(_disconnect(receive))
        try:
            await asyncio.wait({sending, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (sending, gone):
                task.cancel()
            for task in (sending, gone):
                with contextlib.suppress(asyncio.CancelledError, OSError):
                    await task
        if not sending.cancelled():
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _send_all(self, send: Any) -> None:
        try:
            async for event in self.events:
                body = encode_event(event)
                await send({"type": "http.response.body", "body": body, "more_body": True})
        finally:
            close = getattr(self.events, "aclose", None)
            if close is not None:  # a generator: its cleanup cancels the work
                await close()


async def _encoded(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    """Only for Starlette's own sending, which ``__call__`` replaces."""
    async for event in events:  # pragma: no cover
        yield encode_event(event)


async def _disconnect(receive: Any) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
