"""Request bodies: read within a size and a time limit, then parsed as hostile JSON.

Only ``application/json`` bodies are parsed: a browser page can send a
``text/plain`` or form body cross-site without a preflight, never a JSON one
(CSRF). What ``json.loads`` lets through and later code cannot take is refused
here with a 400 that says what to fix: nesting past ``MAX_DEPTH`` (the C decoder
recurses), integers beyond 64 bits (Python's int-from-text limit raises a bare
ValueError, and msgspec cannot encode them), NaN and Infinity (not JSON), and
lone UTF-16 surrogates (valid in a JSON escape, unencodable as UTF-8).
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncGenerator
from typing import Any, Final

from starlette.requests import Request

from dpserve.plumbing.untrusted import MAX_DEPTH, too_deep

JSON_TYPE: Final = "application/json"
_INT_LOW, _INT_HIGH = -(2**63), 2**64 - 1  # what msgpack (and so the wire) can carry
_MAX_INT_DIGITS: Final = 20


class BadBody(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The raw body, no more than ``limit`` bytes, all of it within ``timeout_s``."""
    check_declared(request, limit)
    try:
        return await asyncio.wait_for(_read(request, limit), timeout_s)
    except TimeoutError:
        raise too_slow(timeout_s) from None


def check_declared(request: Request, limit: int) -> None:
    """413 at once for a body whose declared length is over ``limit``."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BadBody(413, f"request body is larger than {limit} bytes")


def too_slow(timeout_s: float) -> BadBody:
    return BadBody(408, f"the request body did not arrive within {timeout_s:g} s; send it at once")


async def limited(request: Request, limit: int) -> AsyncGenerator[bytes, None]:
    """The body's chunks as they arrive; 413 once more than ``limit`` bytes came."""
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BadBody(413, f"request body is larger than {limit} bytes")
        yield chunk


async def _read(request: Request, limit: int) -> bytes:
    return b"".join([chunk async for chunk in limited(request, limit)])


def is_json(content_type: str | None) -> bool:
    """``application/json``, with or without parameters such as ``charset``."""
    if content_type is None:
        return False
    return content_type.split(";", 1)[0].strip().lower() == JSON_TYPE


def parse_object(raw: bytes, content_type: str | None, required: bool) -> dict[str, Any]:
    """The body as a JSON object; an empty body is ``{}`` where the body is optional."""
    if not raw.strip():
        if required:
            raise BadBody(400, "the request needs a JSON object body")
        return {}
    if not is_json(content_type):
        got = f"got {content_type!r}" if content_type else "got none"
        raise BadBody(415, f"send the body as JSON with Content-Type: {JSON_TYPE} ({got})")
    try:
        body = json.loads(raw, parse_int=_int, parse_float=_float, parse_constant=_constant)
    except RecursionError:
        raise BadBody(400, f"the JSON body is nested more than {MAX_DEPTH} levels") from None
    except (UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError is a ValueError
        raise BadBody(400, f"malformed JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise BadBody(400, "the request body must be a JSON object")
    if too_deep(body):
        raise BadBody(400, f"the JSON body is nested more than {MAX_DEPTH} levels")
    if _may_hold_surrogates(raw) and _has_lone_surrogate(body):
        raise BadBody(
            400,
            "the JSON body holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff "
            "escape), which is not text; send valid Unicode",
        )
    return body


def _int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > _MAX_INT_DIGITS or not _INT_LOW <= (value := int(text)) <= _INT_HIGH:
        raise BadBody(400, f"a JSON integer is out of range ({digits} digits): use 64-bit values")
    return value


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise BadBody(400, f"the JSON number {text[:40]} is too large for a 64-bit float")
    return value


def _constant(name: str) -> Any:
    raise BadBody(400, f"{name} is not a JSON value: send finite numbers")


def _may_hold_surrogates(raw: bytes) -> bool:
    """A surrogate reaches a parsed string only as a ``\\u`` escape or its raw UTF-8 form."""
    return b"\\u" in raw or b"\xed" in raw


def _has_lone_surrogate(body: Any) -> bool:
    try:
        json.dumps(body, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return True
    return False
