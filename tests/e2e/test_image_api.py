"""The image API as clients call it: the official `openai` client against `dpserve serve`.

Real HTTP (uvicorn), a real worker with the tiny model: streamed previews that
arrive before the image, edits and inpainting from multipart uploads, formats,
and cancellation by id of a running request while another waits behind it.
"""

from __future__ import annotations

import base64
import io
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from PIL import Image

from tests.polling import eventually
from tests.servers import ServeProcess
from tests.workers import until_denoising

pytestmark = pytest.mark.e2e

EXTRA = {"num_inference_steps": 6, "seed": 11}


@pytest.fixture(scope="module")
def serve(tiny_model: Path) -> Iterator[ServeProcess]:
    with ServeProcess(tiny_model, 1) as running:
        yield running


@pytest.fixture
def client(serve: ServeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{serve.url}/v1", api_key="unused", max_retries=0)


def _png(size: tuple[int, int], color: tuple[int, int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def _mask(size: tuple[int, int]) -> bytes:
    """White (repaint) on the right half."""
    img = Image.new("L", size, 0)
    img.paste(255, (size[0] // 2, 0, size[0], size[1]))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _size(b64: str) -> tuple[int, int]:
    with Image.open(io.BytesIO(base64.b64decode(b64))) as img:
        return img.size


def test_streamed_previews_come_before_the_image_and_change_nothing(
    client: openai.OpenAI, serve: ServeProcess
) -> None:
    plain = client.images.generate(model="tiny", prompt="a red car", size="64x64", extra_body=EXTRA)
    start = time.perf_counter()
    arrivals: list[tuple[float, Any]] = []
    stream = client.images.generate(
        model="tiny",
        prompt="a red car",
        size="64x64",
        stream=True,
        partial_images=2,
        extra_body=EXTRA,
    )
    for event in stream:
        arrivals.append((time.perf_counter() - start, event))
    kinds = [event.type for _, event in arrivals]
    assert kinds == [
        "image_generation.partial_image",
        "image_generation.partial_image",
        "image_generation.completed",
    ]
    assert [event.partial_image_index for _, event in arrivals[:2]] == [0, 1]
    assert arrivals[0][0] < arrivals[-1][0]
    assert all(_size(event.b64_json) == (64, 64) for _, event in arrivals)
    # Previews are extra work on the side: the image is the one a plain request gets.
    assert plain.data is not None
    assert arrivals[-1][1].b64_json == plain.data[0].b64_json
    ids = {event.model_extra.get("id") for _, event in arrivals}
    assert len(ids) == 1 and None not in ids


def test_edits_and_inpainting_through_the_openai_client(client: openai.OpenAI) -> None:
    source = _png((64, 48), (200, 30, 30))
    edited = client.images.edit(
        model="tiny",
        image=("in.png", source, "image/png"),
        prompt="a blue house",
        extra_body={**EXTRA, "strength": 0.7},
    )
    again = client.images.edit(
        model="tiny",
        image=("in.png", source, "image/png"),
        prompt="a blue house",
        extra_body={**EXTRA, "strength": 0.7},
    )
    assert edited.data is not None and again.data is not None
    assert edited.data[0].b64_json == again.data[0].b64_json  # same seed, same bytes
    assert _size(edited.data[0].b64_json or "") == (64, 48)  # the input's size by default
    painted = client.images.edit(
        model="tiny",
        image=("in.png", source, "image/png"),
        mask=("mask.png", _mask((64, 48)), "image/png"),
        prompt="a blue house",
        n=2,
        extra_body=EXTRA,
    )
    assert painted.data is not None and len(painted.data) == 2
    with pytest.raises(openai.BadRequestError, match="mask"):
        client.images.edit(
            model="tiny",
            image=("in.png", source, "image/png"),
            mask=("mask.png", _mask((32, 32)), "image/png"),
            prompt="a blue house",
            extra_body=EXTRA,
        )
    for junk in (b"not a png", b"\x89PNG\r\n\x1a\n" + b"garbage"):
        with pytest.raises(openai.BadRequestError, match="image") as unreadable:
            client.images.edit(model="tiny", image=("in.png", junk, "image/png"), prompt="x")
        assert "0x" not in unreadable.value.message  # no Python repr of Pillow's file object
        assert unreadable.value.code == "invalid_value"


def test_a_variation_is_served_as_an_edit_without_a_prompt(client: openai.OpenAI) -> None:
    source = _png((64, 48), (30, 120, 200))
    ask: dict[str, Any] = {"image": ("in.png", source, "image/png"), "n": 2, "extra_body": EXTRA}
    varied = client.images.create_variation(model="tiny", **ask)
    again = client.images.create_variation(**ask)
    assert varied.data is not None and again.data is not None and len(varied.data) == 2
    images = [base64.b64decode(d.b64_json or "") for d in varied.data]
    assert images == [base64.b64decode(d.b64_json or "") for d in again.data]  # same seeds
    assert images[0] != images[1] and source not in images
    assert all(_size(d.b64_json or "") == (64, 48) for d in varied.data)  # the input's size
    with pytest.raises(openai.BadRequestError, match="/v1/images/edits"):
        client.images.create_variation(
            model="tiny", image=ask["image"], extra_body={**EXTRA, "prompt": "a dog"}
        )


def test_output_compression_and_the_format_are_reported(serve: ServeProcess) -> None:
    def jpeg(compression: int | None) -> dict[str, Any]:
        body: dict[str, Any] = {"prompt": "a tree", "size": "64x64", "output_format": "jpeg"}
        if compression is not None:
            body["output_compression"] = compression
        answer = serve.http.post("/v1/images/generations", json={**body, **EXTRA})
        assert answer.status_code == 200, answer.text
        result: dict[str, Any] = answer.json()
        return result

    best, small = jpeg(None), jpeg(10)
    assert best["output_format"] == "jpeg" and best["encode_time_s"] >= 0
    assert len(small["data"][0]["b64_json"]) < len(best["data"][0]["b64_json"])
    png = serve.http.post(
        "/v1/images/generations",
        json={"prompt": "a tree", "output_compression": 50},
    )
    assert png.status_code == 400 and "jpeg and webp" in png.json()["error"]["message"]


def test_cancel_a_running_request_by_id_and_the_queue_moves_on(serve: ServeProcess) -> None:
    small = {"prompt": "a dog", "size": "64x64", "num_inference_steps": 10, "seed": 1}
    timed = serve.http.post("/v1/images/generations", json=small)
    step_s = timed.json()["inference_time_s"] / 10  # a 64x64 step, and a request's overhead
    # Bigger steps than the timed ones: still running long after the next one queues,
    # however much of the timed request was overhead rather than steps.
    long = {**small, "size": "512x512", "num_inference_steps": 100}
    outcome: dict[str, httpx.Response] = {}

    def call(name: str, body: dict[str, Any], rid: str) -> None:
        outcome[name] = serve.http.post(
            "/v1/images/generations", json=body, headers={"X-Request-Id": rid}
        )

    with serve.driver() as pinger:
        first = threading.Thread(target=call, args=("long", long, "e2e-long"))
        first.start()
        until_denoising(pinger)
        second = threading.Thread(
            target=call, args=("next", {**small, "num_inference_steps": 2}, "e2e-next")
        )
        second.start()
        # Queued at the replica behind the long one (the router sends 2 at once).
        eventually(lambda: pinger.ping().queue_depth == 1, timeout_s=30, poll_s=0.02)
    cancelled_at = time.perf_counter()
    answer = serve.http.post("/v1/images/e2e-long/cancel")
    assert answer.status_code == 200, answer.text
    assert answer.json()["id"] == "e2e-long"
    first.join(60)
    second.join(60)
    waited = time.perf_counter() - cancelled_at
    assert outcome["long"].status_code == 499, outcome["long"].text
    assert outcome["long"].headers["X-Request-Id"] == "e2e-long"
    assert outcome["next"].status_code == 200
    # The long request had about 90 steps left; the next one started within a few.
    assert waited < 40 * step_s + 2.0
    again = serve.http.post("/v1/images/e2e-long/cancel")
    assert again.status_code == 409, again.text
    assert serve.http.post("/v1/images/nobody-asked/cancel").status_code == 404


def test_discovery_says_what_the_model_supports(serve: ServeProcess) -> None:
    models = serve.http.get("/v1/models").json()["data"][0]
    info = serve.http.get("/model_info").json()
    for features in (models["features"], info["features"]):
        assert features["edits"] and features["inpainting"]
        assert features["partial_images"] == 3
        assert set(features["output_formats"]) == {"png", "jpeg", "webp"}
