"""A user edits an image with Qwen-Image-Edit through the router's HTTP, against a
replica split over two ranks (ulysses2): ``POST /v1/images/edits`` as multipart, as the
OpenAI client sends it. The image is the one a single rank makes (within one grey level,
through its ZMQ front), at the upload's size; a request without an image is refused
with the route to use, one with a mask as not served; discovery says the model edits
and previews."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openai
import pytest
from PIL import Image

from dpserve.contract import protocol as p
from tests.integration.test_qwen_image_edit_parallel import reference_png
from tests.servers import ServeProcess
from tests.workers import WorkerProcess

pytestmark = pytest.mark.e2e

FIELDS = {"num_inference_steps": 2, "seed": 5, "negative_prompt": "ugly blurry"}
PROMPT = "a red fox in snow"


@pytest.fixture(scope="module")
def serve(tiny_qwen_edit_model: Path) -> Iterator[ServeProcess]:
    with ServeProcess(tiny_qwen_edit_model, 1, "--sp", "2") as running:
        yield running


def _pixels(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png))).astype(np.int16)


def test_an_edit_through_the_router_matches_one_rank(
    serve: ServeProcess, tiny_qwen_edit_model: Path
) -> None:
    client = openai.OpenAI(base_url=f"{serve.url}/v1", api_key="unused", max_retries=0)
    source = reference_png()
    edited = client.images.edit(
        image=("fox.png", source, "image/png"),
        prompt=PROMPT,
        extra_body={**FIELDS, "true_cfg_scale": 4.0},
    )
    assert edited.data is not None and len(edited.data) == 1
    got = base64.b64decode(edited.data[0].b64_json or "")
    assert _pixels(got).shape == (48, 64, 3)  # the upload's size
    body = {**FIELDS, "prompt": PROMPT, "true_cfg_scale": 4.0, "seed": [5]}
    body["edit"] = {"images": [0]}
    with WorkerProcess(tiny_qwen_edit_model) as one, one.client() as c:
        c.send_raw(p.encode(p.GENERATE, "one", body, [source]))
        reply = c.recv()
    assert reply.kind == p.RESULT, reply.body
    assert int(np.abs(_pixels(got) - _pixels(reply.blobs[0])).max()) <= 1


def test_a_generation_without_an_image_or_with_a_mask_is_refused(serve: ServeProcess) -> None:
    client = openai.OpenAI(base_url=f"{serve.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.APIStatusError, match="/v1/images/edits") as refused:
        client.images.generate(prompt=PROMPT, extra_body=FIELDS)
    assert 400 <= refused.value.status_code < 500
    # Its inpainting sibling ignores the size asked (edit.py): refused by name.
    with pytest.raises(openai.APIStatusError, match="without a mask") as masked:
        client.images.edit(
            image=("fox.png", reference_png(), "image/png"),
            mask=("mask.png", reference_png((255, 255, 255)), "image/png"),
            prompt=PROMPT,
            extra_body=FIELDS,
        )
    assert 400 <= masked.value.status_code < 500


def test_discovery_says_it_edits_and_previews(serve: ServeProcess) -> None:
    models = serve.http.get("/v1/models").json()["data"]
    features = models[0]["features"]
    assert features["edits"] and not features["inpainting"]
    assert features["max_edit_images"] == 1 and features["partial_images"] > 0
