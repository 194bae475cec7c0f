"""Which key each route needs is declared with the route: every route of the app has a
level, the admin routes are exactly the control ops and the two that show the
control state, and a request gets the level of the route the app picks for it."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from fastapi import APIRouter, FastAPI
from starlette.routing import Mount, WebSocketRoute

from dpserve.contract import protocol as p
from dpserve.router.access import (
    ADMIN,
    INFERENCE,
    OPEN,
    Levels,
    admin,
    declared,
    inference,
    public,
)
from dpserve.router.app import RouterSettings, create_app
from dpserve.router.routes import control, flat

ADMIN_ROUTES = frozenset(
    {
        "/update_weights_from_disk",
        "/release_memory_occupation",
        "/resume_memory_occupation",
        "/v1/set_lora",
        "/v1/merge_lora_weights",
        "/v1/unmerge_lora_weights",
        "/v1/list_loras",
        "/get_weights_checksum",
        "/server_info",
        "/health/replicas",
        "/v1/usage",
    }
)
OPEN_ROUTES = frozenset(
    {
        "/livez",
        "/ready",
        "/health",
        "/metrics",
        "/openapi.json",
        "/docs",
        "/docs/oauth2-redirect",
        "/docs/assets",  # a mount: every file under it
        "/redoc",
        "/v1/images/files/{name}",
        "/",
        "/playground/playground.js",
        "/playground/playground.css",
    }
)


def _levels() -> Levels:
    return Levels.of(flat(create_app(RouterSettings()).routes))


def test_every_route_of_the_app_declares_its_level() -> None:
    routes = flat(create_app(RouterSettings()).routes)
    undeclared = [getattr(r, "path", r) for r in routes if declared(r) is None]
    assert not undeclared, f"routes without an access level: {undeclared}"
    kinds = {type(r).__name__ for r in routes}
    assert {"APIRoute", "APIWebSocketRoute", "Mount", "Route"} <= kinds, kinds
    assert len(routes) == len(_levels().routes)


def test_the_admin_routes_are_the_control_ops_the_control_state_and_usage() -> None:
    levels = _levels()
    assert levels.declared(ADMIN) == ADMIN_ROUTES
    state = {"/server_info", "/health/replicas"}
    assert {route.path for route in control.ROUTES} | state | {"/v1/usage"} == ADMIN_ROUTES
    assert levels.declared(OPEN) == OPEN_ROUTES
    # Every control op of the wire has its route, but the router's own: model_info (its
    # pings ask it; GET /model_info shows it) and sync_state (its desired-state sync).
    assert {route.op for route in control.ROUTES} == p.CONTROL_OPS - {"model_info", p.SYNC_STATE}


def test_a_route_without_a_level_stops_the_app_from_being_built() -> None:
    api = APIRouter()

    @api.post("/v1/new_control_op")
    async def new_op() -> None:
        pass

    app = FastAPI(openapi_url=None)
    app.include_router(api)
    with pytest.raises(ValueError, match="/v1/new_control_op declares no access level"):
        Levels.of(flat(app.routes))
    plain = FastAPI(openapi_url=None)
    plain.router.routes.append(WebSocketRoute("/ws", new_op))
    with pytest.raises(ValueError, match="/ws declares no access level"):
        Levels.of(flat(plain.routes))
    with pytest.raises(ValueError, match=r"/openapi\.json declares no access level"):
        Levels.of(flat(FastAPI().routes))  # FastAPI's own schema route, undeclared


def test_a_handler_has_one_level() -> None:
    async def handler() -> None:
        pass

    assert admin(handler) is handler and admin(handler) is handler
    with pytest.raises(ValueError, match="declared admin and inference"):
        inference(handler)


def test_a_request_has_the_level_of_the_route_the_app_picks() -> None:
    levels = _levels()
    assert levels.of_path("/v1/images/files/x.png") == OPEN
    assert levels.of_path("/docs/assets/swagger-ui.css") == OPEN
    assert levels.of_path("/v1/images/abc/cancel", "POST") == INFERENCE
    assert levels.of_path("/v1/videos/video_x/content") == INFERENCE
    assert levels.of_path("/health/replicas", "POST") == ADMIN  # a 405, for admins only
    # Paths no route serves need a key, under an open route's path too.
    for path in ("/no/such/route", "/health/", "/docs/assets", "/v1/images/files/a/b"):
        assert levels.of_path(path) == INFERENCE, path
    # A parameter cannot borrow an open route's prefix: this is the cancel route.
    assert levels.of_path("/v1/images/files/cancel", "POST") == INFERENCE
    assert levels.of_path("/v1/images/files/cancel", "GET") == OPEN  # a stored file's name
    websocket = {"type": "websocket", "path": "/v1/realtime_video/generate", "root_path": ""}
    assert levels.of_scope(websocket) == INFERENCE


def test_the_one_lookup_paths_agree_with_routing() -> None:
    levels = _levels()
    replayed = Levels(levels.routes, {}, frozenset(), levels.routes)
    assert len(levels.exact) > 20
    for path, level in levels.exact.items():
        for method in ("GET", "POST", "DELETE"):
            assert replayed.of_path(path, method) == level, (path, method)
    # A path that names no route can only be matched by a parameter's or a mount's.
    assert {route.path for route, _ in levels.patterned} == {  # type: ignore[attr-defined]
        "/v1/images/{request_id}/cancel",
        "/v1/images/files/{name}",
        "/v1/videos/{video_id}",
        "/v1/videos/{video_id}/content",
        "/v1/models/{model_id:path}",
        "/docs/assets",
    }
    for path in ("/v1/images/files/x", "/v1/images/files/cancel", "/v1/models/a/b", "/x"):
        for method in ("GET", "POST"):
            assert levels.of_path(path, method) == replayed.of_path(path, method), path


def test_a_parameter_under_an_open_prefix_needs_the_key_of_its_route() -> None:
    async def scenario() -> tuple[int, int]:
        app = create_app(RouterSettings(api_keys=("K",)))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as http:
            cancel = await http.post("/v1/images/files/cancel")
            stored = await http.get("/v1/images/files/cancel")
        return cancel.status_code, stored.status_code

    assert asyncio.run(scenario()) == (401, 404)


def test_a_mounted_app_and_a_plain_route_carry_their_level() -> None:
    async def page() -> None:
        pass

    app = FastAPI(openapi_url=None)
    app.mount("/files", public(FastAPI()))
    app.router.add_route("/page", public(page))
    levels = Levels.of(flat(app.routes))
    assert isinstance(levels.routes[0][0], Mount)
    assert levels.of_path("/files/x") == OPEN and levels.of_path("/page") == OPEN
    assert levels.of_path("/files") == INFERENCE  # the mount serves what is under it
