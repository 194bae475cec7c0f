"""The playground's routes: the page at ``/`` and its assets, read once from the package.
Open without a key: they are static and hold no secret (every API call the page makes
needs the key the user gives it)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from importlib import resources
from typing import Final

from fastapi import APIRouter
from fastapi.responses import Response

from dpserve.router.access import public
from dpserve.router.playground import ASSET_PREFIX, ASSETS, PAGE

# The page runs only its own files and talks only to this router; the key it holds
# is then out of reach of any injected script or frame.
_HEADERS: Final = {
    "content-security-policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self' data: blob:; media-src 'self' blob:; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-cache",  # revalidated, so an upgraded router serves its own page
}


def _read(name: str) -> bytes:
    return (resources.files(__package__) / "static" / name).read_bytes()


def _serve(body: bytes, media_type: str) -> Callable[[], Awaitable[Response]]:
    @public
    async def asset() -> Response:
        return Response(body, media_type=media_type, headers=_HEADERS)

    return asset


def router() -> APIRouter:
    """The page and its files (not in the API schema: they are not the API)."""
    api = APIRouter()
    api.get("/", include_in_schema=False)(_serve(_read(PAGE), "text/html; charset=utf-8"))
    for name, media_type in ASSETS.items():
        api.get(ASSET_PREFIX + name, include_in_schema=False)(_serve(_read(name), media_type))
    return api
