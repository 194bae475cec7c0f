"""A real headless Chromium (Debian's, installed by tests/browser/setup.sh) driven by
Playwright, and where the browser tests leave what a person should look at."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = Path("/usr/bin/chromium")
# Without the networking flags Chromium phones home at start-up, which this closed
# network refuses; --headless and --no-sandbox let it run as root in a container.
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
# Stable and git-ignored: screenshots of each state and the timings the tests measured.
OUTPUT = Path(__file__).resolve().parents[2] / ".test-output" / "playground"
SCHEMES = ("light", "dark")


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Per module: Playwright's sync API holds an event loop on this thread while it
    runs, which would break every later test that calls asyncio.run."""
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: run tests/browser/setup.sh (make test does)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        yield chromium
        chromium.close()


@pytest.fixture(scope="session")
def output() -> Path:
    OUTPUT.mkdir(parents=True, exist_ok=True)
    return OUTPUT


@pytest.fixture(scope="session")
def figures(output: Path) -> Iterator[dict[str, Any]]:
    """Figures the tests measured, written to timings.json when the session ends."""
    found: dict[str, Any] = {}
    yield found
    if found:
        path = output / "timings.json"
        old = json.loads(path.read_text()) if path.exists() else {}
        path.write_text(json.dumps({**old, **found}, indent=2, sort_keys=True) + "\n")


@pytest.fixture()
def open_page(browser: Any) -> Iterator[Callable[..., Any]]:
    """``open_page(url, scheme)``: a fresh tab (its own sessionStorage) in that colour
    scheme; script errors on any page fail the test."""
    contexts: list[Any] = []
    errors: list[str] = []

    def open_(url: str, scheme: str = "light") -> Any:
        context = browser.new_context(
            color_scheme=scheme, viewport={"width": 1000, "height": 900}, accept_downloads=True
        )
        contexts.append(context)
        page = context.new_page()
        page.on("pageerror", lambda error: errors.append(str(error)))
        page.goto(url)
        return page

    yield open_
    for context in contexts:
        context.close()
    assert not errors, errors
