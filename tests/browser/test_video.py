"""The playground in a real Chromium against `dpserve serve` with the tiny video model (no
keys): the page shows only the video part, follows a job's progress and plays its mp4.

Debian's Chromium plays the H.264 mp4 a job makes (``canPlayType`` says "probably" for
avc1 and the element decodes and plays it), so the test asserts playback itself.
Screenshots (``video-light.png``, ``video-dark.png``) and timings go to
``.test-output/playground/`` (git-ignored).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.browser.conftest import SCHEMES
from tests.servers import ServeProcess

pytestmark = pytest.mark.browser

WAIT_MS = 120_000


@pytest.fixture(scope="module")
def serve(tiny_video_model: Path) -> Iterator[ServeProcess]:
    with ServeProcess(tiny_video_model, 1, timeout_s=300) as running:
        yield running


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_video_job_shows_its_progress_and_plays(
    serve: ServeProcess,
    open_page: Callable[..., Any],
    output: Path,
    figures: dict[str, Any],
    scheme: str,
) -> None:
    page = open_page(serve.url, scheme)
    page.wait_for_selector("body[data-ready=true]", timeout=WAIT_MS)
    assert page.is_visible("#video")
    assert not page.is_visible("#generate") and not page.is_visible("#edit")
    assert not page.is_visible("#key-form")  # no keys on this server
    assert page.text_content("#status") == "This server makes videos."
    assert (
        page.evaluate(
            "(t) => document.createElement('video').canPlayType(t)",
            'video/mp4; codecs="avc1.42E01E"',
        )
        == "probably"
    )

    page.fill("#video-form input[name=size]", "64x48")
    page.fill("#video-form input[name=seconds]", "1")
    page.fill("#video-form input[name=steps]", "3")
    page.fill("#video-form input[name=seed]", "7")
    page.click("#video-form button[type=submit]")
    page.wait_for_selector("#video-player[data-playing=true]", timeout=WAIT_MS)
    assert page.get_attribute("#video", "data-state") == "completed"
    assert page.evaluate("document.getElementById('video-progress').value") == 100

    listed = serve.http.get("/v1/videos", params={"limit": 1}).json()["data"][0]
    assert listed["status"] == "completed" and listed["size"] == "64x48"
    frames, fps = listed["num_frames"], listed["fps"]
    player = page.evaluate(
        "() => { const v = document.getElementById('video-player');"
        " return {duration: v.duration, width: v.videoWidth, height: v.videoHeight,"
        " paused: v.paused, time: v.currentTime}; }"
    )
    assert (player["width"], player["height"]) == (64, 48)
    assert abs(player["duration"] - frames / fps) < 1 / fps
    assert not player["paused"]
    page.wait_for_function(  # the clock moves: frames are being shown
        "(t) => document.getElementById('video-player').currentTime !== t", arg=player["time"]
    )
    with page.expect_download() as started:
        page.click("#video-download")
    mp4 = Path(started.value.path()).read_bytes()
    assert mp4 == serve.http.get(f"/v1/videos/{listed['id']}/content").content
    page.screenshot(path=output / f"video-{scheme}.png", full_page=True)

    start = page.evaluate("performance.getEntriesByName('video:start')[0].startTime")
    playing = page.evaluate("performance.getEntriesByName('video:playing')[0].startTime")
    paint = page.evaluate("performance.getEntriesByName('first-contentful-paint')[0].startTime")
    figures[f"video_{scheme}"] = {
        "first_contentful_paint_ms": round(paint, 1),
        "submit_to_playing_ms": round(playing - start, 1),
        "request": f"64x48, {frames} frames at {fps} fps, 3 steps, tiny video model",
    }
