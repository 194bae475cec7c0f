"""/docs and /redoc work without internet: every file they load is the router's own."""

from __future__ import annotations

import asyncio
import re

import httpx

from dpserve.router.app import RouterSettings, create_app

# A keyed router: the pages and their files must stay open (a browser sends no key).
SETTINGS = RouterSettings(workers=("tcp://127.0.0.1:1",), api_keys=("sk-docs-test-key",))
TYPES = {".js": "text/javascript", ".css": "text/css", ".png": "image/png"}


def _referenced(html: str) -> list[str]:
    """Every URL a page loads: src and href attributes, the schema it renders."""
    attrs = re.findall(r'(?:src|href|spec-url)="([^"]+)"', html)
    return attrs + re.findall(r"url: '([^']+)'", html)


def _get(*paths: str) -> list[httpx.Response]:
    async def run() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=create_app(SETTINGS))
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as http:
            return [await http.get(path) for path in paths]

    return asyncio.run(run())


def test_the_pages_load_only_the_routers_own_files() -> None:
    swagger, redoc = _get("/docs", "/redoc")
    for page in (swagger, redoc):
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "//" not in "".join(_referenced(page.text))  # no scheme, no host: this router
        assert not re.search(r"https?://", page.text)  # no CDN, no fonts, no validator
    loads = {*_referenced(swagger.text), *_referenced(redoc.text)}
    assert {
        "/openapi.json",
        "/docs/assets/swagger-ui-bundle.js",
        "/docs/assets/swagger-ui.css",
    } <= loads
    assert "/docs/assets/redoc.standalone.js" in loads
    files = sorted(u for u in loads if u.startswith("/docs/assets/"))
    for url, answer in zip(files, _get(*files), strict=True):
        assert answer.status_code == 200, url
        suffix = url[url.rindex(".") :]
        assert answer.headers["content-type"].split(";")[0] == TYPES[suffix], url
        assert len(answer.content) > 1000, url  # the real file, not a stub
    (schema,) = _get("/openapi.json")
    assert schema.status_code == 200 and schema.json()["info"]["title"] == "dpserve router"


def test_the_bundles_are_the_real_ones_and_an_unknown_asset_is_a_json_404() -> None:
    bundle, redoc_js, missing = _get(
        "/docs/assets/swagger-ui-bundle.js", "/docs/assets/redoc.standalone.js", "/docs/assets/x.js"
    )
    assert b"SwaggerUIBundle" in bundle.content
    assert b"Redoc" in redoc_js.content
    assert missing.status_code == 404 and "error" in missing.json()
