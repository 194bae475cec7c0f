"""Request ids: a client's ``X-Request-Id`` is honoured (checked), else one is made.

The pure ASGI middleware puts the id in the scope before any route runs and on
every response's headers (errors, refusals and streams included); handlers put it
in their bodies too. The same id names the request on the wire to the replica, so a
cancel by id reaches it there, from this router or another.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Final

from dpserve.contract.protocol import (
    FieldError,
)
from dpserve.router.openai_api import error_body

HEADER: Final = "X-Request-Id"
SCOPE_KEY: Final = "dpserve.request_id"
MAX_CHARS: Final = 128
_VALID: Final = re.compile(r"[A-Za-z0-9._:-]{1,128}")
RULE: Final = f"1-{MAX_CHARS} characters of A-Z a-z 0-9 . _ : -"


def new_id(path: str = "") -> str:
    """``img-`` for an image request (its id is what a cancel names), ``req-`` otherwise."""
    prefix = "img" if path.startswith("/v1/images/") else "req"
    return f"{prefix}-{uuid.uuid4().hex}"


def valid(request_id: str) -> bool:
    return _VALID.fullmatch(request_id) is not None


def of_scope(scope: Any) -> str:
    """The request's id (the middleware set it); a fresh one outside it (tests)."""
    found = scope.get(SCOPE_KEY)
    return found if isinstance(found, str) else new_id(scope.get("path", ""))


class RequestIdMiddleware:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":  # realtime sessions name themselves (docs/realtime.md)
            await self.app(scope, receive, send)
            return
        sent = [v for k, v in scope.get("headers", ()) if k.lower() == b"x-request-id"]
        request_id = sent[0].decode("latin-1") if sent else new_id(scope["path"])
        if sent and (len(sent) > 1 or not valid(request_id)):
            await _refuse(send, len(sent), new_id(scope["path"]))
            return
        scope[SCOPE_KEY] = request_id
        header = (b"x-request-id", request_id.encode())

        async def send_with_id(message: Any) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), header]}
            await send(message)

        await self.app(scope, receive, send_with_id)


async def _refuse(send: Any, count: int, request_id: str) -> None:
    """400 in the one error shape, under an id of the router's (the client's is unusable)."""
    why = "was sent more than once" if count > 1 else f"must be {RULE}"
    message = f"the {HEADER} header {why}; or send none"
    field = [FieldError(HEADER, why)]
    body = json.dumps(error_body(400, message, field, request_id)).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", b"%d" % len(body)),
        (b"x-request-id", request_id.encode()),
    ]
    await send({"type": "http.response.start", "status": 400, "headers": headers})
    await send({"type": "http.response.body", "body": body})
