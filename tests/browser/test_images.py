"""The playground in a real Chromium against `dpserve serve --api-key` with the tiny image
model: the key, a streamed generation, and an edit with a mask painted with the mouse.

Screenshots of each state, in light and dark, and the timings measured here go to
``.test-output/playground/`` (git-ignored): ``locked-*.png``, ``generated-*.png``,
``edited-*.png``, ``timings.json``.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image

from tests.browser.conftest import SCHEMES
from tests.servers import ServeProcess

pytestmark = pytest.mark.browser

KEY = "sk-playground-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
WAIT_MS = 60_000


@pytest.fixture(scope="module")
def serve(tiny_model: Path) -> Iterator[ServeProcess]:
    with ServeProcess(tiny_model, 1, "--api-key", KEY) as running:
        yield running


def _pixels(png: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(png)) as img:
        return np.asarray(img.convert("RGBA"))


def _unlock(page: Any, key: str = KEY) -> None:
    page.wait_for_selector("#key-form:not([hidden])", timeout=WAIT_MS)
    page.fill("#key", key)
    page.click("#key-form button[type=submit]")


def _download(page: Any, selector: str) -> bytes:
    with page.expect_download() as started:
        page.click(selector)
    return Path(started.value.path()).read_bytes()


def _mark(page: Any, name: str) -> float:
    return float(page.evaluate("(n) => performance.getEntriesByName(n)[0].startTime", name))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_without_a_key_the_page_shows_the_401s_message_and_keeps_a_key_for_the_tab_only(
    serve: ServeProcess, open_page: Callable[..., Any], output: Path, scheme: str
) -> None:
    refused = httpx.get(f"{serve.url}/v1/models")
    assert refused.status_code == 401
    message = refused.json()["error"]["message"]
    page = open_page(serve.url, scheme)
    page.wait_for_selector("#error:not([hidden])", timeout=WAIT_MS)
    assert page.text_content("#error") == f"401: {message}"
    assert page.text_content("#status") == "This server needs an API key."
    assert page.is_visible("#key-form") and not page.is_visible("#generate")
    page.screenshot(path=output / f"locked-{scheme}.png", full_page=True)

    _unlock(page, "sk-wrong")
    page.wait_for_function(
        "() => document.getElementById('error').textContent.includes('not valid')"
    )
    assert page.is_visible("#key-form")
    _unlock(page)
    page.wait_for_selector("body[data-ready=true]", timeout=WAIT_MS)
    assert page.is_visible("#generate") and page.is_visible("#edit")
    assert not page.is_visible("#video")  # an image model: its features show no video
    assert not page.is_visible("#key-form") and not page.is_visible("#error")
    assert page.evaluate("sessionStorage.getItem('dpserve.apiKey')") == KEY
    page.reload()  # the same tab keeps it
    page.wait_for_selector("body[data-ready=true]", timeout=WAIT_MS)
    other = page.context.new_page()  # another tab does not
    other.goto(serve.url)
    other.wait_for_selector("#key-form:not([hidden])", timeout=WAIT_MS)
    assert other.evaluate("sessionStorage.getItem('dpserve.apiKey')") is None


@pytest.mark.parametrize("scheme", SCHEMES)
def test_the_page_streams_previews_then_the_image_the_api_makes(
    serve: ServeProcess,
    open_page: Callable[..., Any],
    output: Path,
    figures: dict[str, Any],
    scheme: str,
) -> None:
    page = open_page(serve.url, scheme)
    _unlock(page)
    page.wait_for_selector("body[data-ready=true]", timeout=WAIT_MS)
    page.fill("#generate-form input[name=size]", "128x128")
    page.fill("#generate-form input[name=steps]", "8")
    page.fill("#generate-form input[name=seed]", "3")
    page.fill("#generate-form input[name=previews]", "2")
    page.click("#generate-form button[type=submit]")
    page.wait_for_selector("#generate[data-state=done]", timeout=WAIT_MS)

    shown = page.eval_on_selector_all(
        "#generate-events li", "items => items.map(i => [i.dataset.type, Number(i.dataset.ms)])"
    )
    assert [kind for kind, _ in shown] == ["preview", "preview", "image"]
    times = [ms for _, ms in shown]
    assert times == sorted(times) and times[1] < times[2]  # previews came before the image
    assert page.get_attribute("#generate-image", "data-kind") == "image"
    src = page.get_attribute("#generate-image", "src")
    assert src.startswith("data:image/png;base64,")
    answer = serve.http.post(
        "/v1/images/generations",
        json={
            "prompt": "a lighthouse on a cliff at sunset",
            "size": "128x128",
            "num_inference_steps": 8,
            "seed": 3,
        },
        headers=AUTH,
    )
    assert answer.status_code == 200, answer.text
    api_png = base64.b64decode(answer.json()["data"][0]["b64_json"])
    page_png = base64.b64decode(src.split(",", 1)[1])
    assert np.array_equal(_pixels(page_png), _pixels(api_png))
    assert "seed 3 · 128x128" in page.text_content("#generate-caption")
    page.screenshot(path=output / f"generated-{scheme}.png", full_page=True)

    paint = page.evaluate("performance.getEntriesByName('first-contentful-paint')[0].startTime")
    start = _mark(page, "generate:start")
    figures[f"generate_{scheme}"] = {
        "first_contentful_paint_ms": round(paint, 1),
        "first_preview_ms": round(_mark(page, "generate:first-preview") - start, 1),
        "image_ms": round(_mark(page, "generate:image") - start, 1),
        "request": "128x128, 8 steps, 2 previews, tiny model, one replica",
    }

    page.click("#to-edit")  # the image just made becomes the edit's source
    page.wait_for_function("() => document.getElementById('mask-canvas').width === 128")
    assert page.evaluate("document.getElementById('edit-source').naturalHeight") == 128


def _source() -> bytes:
    """A smooth gradient: any change the model makes shows against it."""
    ys, xs = np.mgrid[0:64, 0:64]
    rgb = np.stack([xs * 4, ys * 4, 255 - xs * 2], axis=-1).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb, "RGB").save(buf, format="PNG")
    return buf.getvalue()


def _near_segment(shape: tuple[int, int], a: tuple[float, float], b: tuple[float, float]) -> Any:
    """Each pixel centre's distance to the segment a-b, in pixels."""
    ys, xs = np.mgrid[0 : shape[0], 0 : shape[1]] + 0.5
    ax, ay = a
    dx, dy = b[0] - ax, b[1] - ay
    t = np.clip(((xs - ax) * dx + (ys - ay) * dy) / (dx * dx + dy * dy), 0, 1)
    return np.hypot(xs - (ax + t * dx), ys - (ay + t * dy))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_mask_painted_with_the_mouse_changes_only_the_masked_area(
    serve: ServeProcess,
    open_page: Callable[..., Any],
    output: Path,
    figures: dict[str, Any],
    scheme: str,
) -> None:
    source = _source()
    page = open_page(serve.url, scheme)
    _unlock(page)
    page.wait_for_selector("body[data-ready=true]", timeout=WAIT_MS)
    page.set_input_files(
        "#edit-form input[name=image]",
        files=[{"name": "gradient.png", "mimeType": "image/png", "buffer": source}],
    )
    page.wait_for_function("() => document.getElementById('mask-canvas').width === 64")
    canvas = page.locator("#mask-canvas")
    canvas.scroll_into_view_if_needed()
    box = canvas.bounding_box()
    radius = float(page.input_value("#edit-form input[name=brush]"))
    a, b = (16.0, 20.0), (44.0, 36.0)  # in the image's pixels

    def at(point: tuple[float, float]) -> tuple[float, float]:
        return box["x"] + point[0] * box["width"] / 64, box["y"] + point[1] * box["height"] / 64

    page.mouse.move(*at(a))
    page.mouse.down()
    page.mouse.move(*at(b), steps=12)
    page.mouse.up()
    page.fill("#edit-form input[name=steps]", "8")
    page.fill("#edit-form input[name=seed]", "5")
    page.click("#edit-form button[type=submit]")
    page.wait_for_selector("#edit[data-state=done]", timeout=WAIT_MS)
    assert page.get_attribute("#edit-image", "data-pasted") == "true"

    mask_png = _download(page, "#edit-mask")
    repaint = _pixels(mask_png)[..., 3] == 0  # OpenAI's masks: transparent = repaint
    distance = _near_segment(repaint.shape, a, b)
    assert repaint[distance <= radius - 1].all()  # the stroke, brush-wide, is in the mask
    assert not repaint[distance > radius + 1].any()  # and nothing away from it

    raw_png = _download(page, "#edit-raw")
    answer = serve.http.post(
        "/v1/images/edits",
        data={"prompt": "a stained glass window", "num_inference_steps": "8", "seed": "5"},
        files={
            "image": ("gradient.png", source, "image/png"),
            "mask": ("mask.png", mask_png, "image/png"),
        },
        headers=AUTH,
    )
    assert answer.status_code == 200, answer.text
    api = _pixels(base64.b64decode(answer.json()["data"][0]["b64_json"]))
    raw = _pixels(raw_png)
    assert np.array_equal(raw, api)  # the page sent that image, that mask, those fields

    shown = _pixels(_download(page, "#edit-shown"))
    src = _pixels(source)
    assert np.array_equal(shown[~repaint], src[~repaint])  # outside: the source, exactly
    assert np.array_equal(shown[repaint], raw[repaint])  # inside: the model's pixels
    changed = np.abs(raw[repaint].astype(int) - src[repaint].astype(int)).mean()
    assert changed > 5
    page.screenshot(path=output / f"edited-{scheme}.png", full_page=True)
    # What the pipeline's own answer does outside the mask (the page pastes the source
    # back there): the inpainting pipeline re-decodes the whole image.
    outside = np.abs(raw[~repaint].astype(int) - src[~repaint].astype(int))
    figures["edit_model_output_outside_mask"] = {
        "mean_abs_diff": round(float(outside.mean()), 1),
        "max_abs_diff": int(outside.max()),
        "masked_fraction": round(float(repaint.mean()), 3),
    }
