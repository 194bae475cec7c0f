"""``/docs`` (Swagger UI) and ``/redoc`` over ``/openapi.json``, their scripts, style
and icon served by the router itself from the files the fastapi-offline package
ships: FastAPI's own pages load them from a CDN, which leaves them blank on a
machine without internet (an air-gapped cluster, a laptop offline)."""

from __future__ import annotations

from importlib.resources import files

from fastapi import FastAPI, Request
from fastapi.openapi.docs import (
    get_redoc_html,
    get_swagger_ui_html,
    get_swagger_ui_oauth2_redirect_html,
)
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

ASSETS = "/docs/assets"  # open without a key, as the pages are (dpserve/router/auth.py)
SWAGGER_OAUTH2_REDIRECT = "/docs/oauth2-redirect"


def install(app: FastAPI) -> None:
    """The pages, for an app made with ``docs_url=None, redoc_url=None``."""
    static = files("fastapi_offline") / "static"
    app.mount(ASSETS, StaticFiles(directory=str(static)), name="docs-assets")
    openapi = app.openapi_url or "/openapi.json"

    async def swagger(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_swagger_ui_html(
            openapi_url=root + openapi,
            title=f"{app.title} - Swagger UI",
            swagger_js_url=f"{root}{ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{root}{ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{root}{ASSETS}/favicon.png",
            oauth2_redirect_url=root + SWAGGER_OAUTH2_REDIRECT,
            # No badge from swagger.io's validator: it would send the schema's URL out.
            swagger_ui_parameters={"validatorUrl": None, **(app.swagger_ui_parameters or {})},
        )

    async def oauth2_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    async def redoc(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_redoc_html(
            openapi_url=root + openapi,
            title=f"{app.title} - ReDoc",
            redoc_js_url=f"{root}{ASSETS}/redoc.standalone.js",
            redoc_favicon_url=f"{root}{ASSETS}/favicon.png",
            with_google_fonts=False,  # fonts from Google are a CDN too
        )

    app.add_api_route("/docs", swagger, methods=["GET"], include_in_schema=False)
    app.add_api_route(
        SWAGGER_OAUTH2_REDIRECT, oauth2_redirect, methods=["GET"], include_in_schema=False
    )
    app.add_api_route("/redoc", redoc, methods=["GET"], include_in_schema=False)
