"""The playground's page and files: served from the package, open without a key, shipped in
the wheel. The page itself is driven in a real browser in tests/browser."""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import httpx

from dpserve.router.access import INFERENCE, OPEN, Levels
from dpserve.router.app import RouterSettings, create_app
from dpserve.router.playground import ASSETS, PAGE, PATHS
from dpserve.router.routes import flat

ROOT = Path(__file__).resolve().parents[2]
STATIC = ROOT / "dpserve" / "router" / "playground" / "static"


def _get(path: str, **settings: object) -> httpx.Response:
    """One GET through the whole app (middleware included); no replica is needed."""

    async def scenario() -> httpx.Response:
        app = create_app(RouterSettings(**settings))  # type: ignore[arg-type]
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as http:
            return await http.get(path)

    return asyncio.run(scenario())


def test_the_page_and_its_files_are_served_without_a_key_while_the_api_needs_one() -> None:
    page = _get("/", api_keys=("K",))
    assert page.status_code == 200
    assert page.headers["content-type"] == "text/html; charset=utf-8"
    assert page.content == (STATIC / PAGE).read_bytes()
    csp = page.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "connect-src 'self'" in csp
    for name, media_type in ASSETS.items():
        asset = _get(f"/playground/{name}", api_keys=("K",))
        assert (asset.status_code, asset.headers["content-type"]) == (200, media_type)
        assert asset.content == (STATIC / name).read_bytes()
    refused = _get("/v1/models", api_keys=("K",))
    assert refused.status_code == 401
    assert "Authorization: Bearer" in refused.json()["error"]["message"]


def test_only_the_pages_own_paths_are_open() -> None:
    access = Levels.of(flat(create_app(RouterSettings()).routes)).of_path
    assert {access(path) for path in PATHS} == {OPEN}
    assert access("/playground/other.js") == INFERENCE
    assert _get("/playground/other.js", api_keys=("K",)).status_code == 401
    missing = _get("/playground/other.js")
    assert missing.status_code == 404 and "no route" in missing.json()["error"]["message"]


def test_the_page_is_not_in_the_api_schema() -> None:
    schema = _get("/openapi.json").json()
    assert not set(schema["paths"]) & PATHS


def test_every_file_the_page_loads_is_served_and_every_served_file_exists() -> None:
    html = (STATIC / PAGE).read_text()
    loaded = set(re.findall(r'(?:src|href)="/playground/([^"]+)"', html))
    assert loaded == set(ASSETS)
    assert {p.name for p in STATIC.iterdir()} == {PAGE, *ASSETS}
    assert "http://" not in html and "https://" not in html  # no CDN


def test_the_wheel_ships_the_page(tmp_path: Path) -> None:
    """A wheel built from a copy of the tree (no git, so only the declared package data
    goes in) holds every file the routes read."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "dpserve", src / "dpserve", ignore=shutil.ignore_patterns("__pycache__"))
    build = f"from setuptools import build_meta as b; print(b.build_wheel({str(tmp_path)!r}))"
    out = subprocess.run(
        [sys.executable, "-c", build], cwd=src, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    wheel = tmp_path / out.stdout.strip().splitlines()[-1]
    with zipfile.ZipFile(wheel) as archive:
        for name in (PAGE, *ASSETS):
            shipped = archive.read(f"dpserve/router/playground/static/{name}")
            assert shipped == (STATIC / name).read_bytes()
