"""The API's description, open without a key (it holds no secret): ``/openapi.json``,
``/docs`` (Swagger UI) and ``/redoc`` over it, their scripts, style and icon served by
the router itself from the files the fastapi-offline package ships: FastAPI's own
pages load them from a CDN, which leaves them blank on a machine without internet (an
air-gapped cluster, a laptop offline)."""

from __future__ import annotations

from importlib.resources import files

from fastapi import APIRouter, Request
from fastapi.openapi.docs import (
    get_redoc_html,
    get_swagger_ui_html,
    get_swagger_ui_oauth2_redirect_html,
)
from fastapi.responses import HTMLResponse, JSONResponse
from fastapi.staticfiles import StaticFiles

from dpserve.router.access import public

OPENAPI = "/openapi.json"
ASSETS = "/docs/assets"
SWAGGER_OAUTH2_REDIRECT = "/docs/oauth2-redirect"


def assets() -> StaticFiles:
    """The pages' files, mounted at ``ASSETS`` by ``create_app`` (an ``APIRouter``
    before FastAPI 0.137 drops the mounts it holds when it is included)."""
    return public(StaticFiles(directory=str(files("fastapi_offline") / "static")))


@public
async def openapi(request: Request) -> JSONResponse:
    """The schema; served under a root path (behind a proxy), with that path as its
    first server, so the pages' "Try it out" calls go through the proxy too."""
    schema = request.app.openapi()
    root = request.scope.get("root_path", "").rstrip("/")
    if root and root not in {server.get("url") for server in schema.get("servers", [])}:
        schema = {**schema, "servers": [{"url": root}, *schema.get("servers", [])]}
    return JSONResponse(schema)


@public
async def swagger(request: Request) -> HTMLResponse:
    root, app = request.scope.get("root_path", ""), request.app
    return get_swagger_ui_html(
        openapi_url=root + OPENAPI,
        title=f"{app.title} - Swagger UI",
        swagger_js_url=f"{root}{ASSETS}/swagger-ui-bundle.js",
        swagger_css_url=f"{root}{ASSETS}/swagger-ui.css",
        swagger_favicon_url=f"{root}{ASSETS}/favicon.png",
        oauth2_redirect_url=root + SWAGGER_OAUTH2_REDIRECT,
        # No badge from swagger.io's validator: it would send the schema's URL out.
        swagger_ui_parameters={"validatorUrl": None, **(app.swagger_ui_parameters or {})},
    )


@public
async def oauth2_redirect() -> HTMLResponse:
    return get_swagger_ui_oauth2_redirect_html()


@public
async def redoc(request: Request) -> HTMLResponse:
    root = request.scope.get("root_path", "")
    return get_redoc_html(
        openapi_url=root + OPENAPI,
        title=f"{request.app.title} - ReDoc",
        redoc_js_url=f"{root}{ASSETS}/redoc.standalone.js",
        redoc_favicon_url=f"{root}{ASSETS}/favicon.png",
        with_google_fonts=False,  # fonts from Google are a CDN too
    )


def router() -> APIRouter:
    """The pages and the schema, for an app made with ``openapi_url=None,
    docs_url=None, redoc_url=None``; none is in the schema itself."""
    api = APIRouter()
    api.add_route(OPENAPI, openapi, methods=["GET"], include_in_schema=False)
    api.add_api_route("/docs", swagger, methods=["GET"], include_in_schema=False)
    api.add_api_route(
        SWAGGER_OAUTH2_REDIRECT, oauth2_redirect, methods=["GET"], include_in_schema=False
    )
    api.add_api_route("/redoc", redoc, methods=["GET"], include_in_schema=False)
    return api
