"""The router's HTTP routes, one ``APIRouter`` per area (images, videos, info, control,
health, realtime, docs, playground), each built fresh by its module's ``router()`` and
whose routes ``create_app`` adds to the app's own list, so no router object outlives
the app it serves. Each
handler is thin over the service layer, takes what it needs through FastAPI's
``Depends`` (dpserve/router/deps.py) and declares who may call it
(dpserve/router/access.py)."""

from __future__ import annotations

from collections.abc import Iterable

import fastapi.routing
from starlette.routing import BaseRoute


def flat(routes: Iterable[BaseRoute]) -> list[BaseRoute]:
    """An app's routes in the order routing tries them, included routers expanded
    (FastAPI 0.137 and later keep each included router as one node of ``app.routes``).
    ``create_app`` adds the areas' routes themselves; an included router would be expanded."""
    contexts = getattr(fastapi.routing, "iter_route_contexts", None)
    if contexts is None:  # before 0.137, included routes are copied into the app's list
        return list(routes)
    return [context.original_route for context in contexts(list(routes))]
