"""FLUX.2 and SD3 split over sequence parallel, as a client reaches them: `dpserve
serve` (real HTTP, the router, a two-rank gang), previews streamed through the
router, and SD3's per-request text length checked with the CLIP tokens it carries.

SD3's prompt is its CLIP tokenizer's padded length followed by the request's T5
tokens (``max_sequence_length``), and sp splits the two together. The real models'
CLIP length is 77; here a copy of the tiny SD3 with a 31-token CLIP tokenizer (the
tiny one pads to 32, which any even split divides) makes the CLIP part count: under
sp=2 a T5 length of 32 splits alone but not after CLIP's 31.
"""

from __future__ import annotations

import base64
import io
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from tests.polling import eventually
from tests.servers import ServeProcess

pytestmark = [pytest.mark.e2e, pytest.mark.rest_lane]

BASE: dict[str, Any] = {"prompt": "a red fox", "size": "64x64", "num_inference_steps": 4, "seed": 5}
CLIP = 31  # the SD3 copy's CLIP tokens (module docstring)


def _features(serve: ServeProcess) -> dict[str, Any]:
    """The served model's features, once the router has its replica's model_info (it
    asks after the replica's first ping; a busy machine can answer that one late)."""

    def known() -> dict[str, Any] | None:
        return serve.http.get("/v1/models").json()["data"][0]["features"]

    return eventually(known, 30, "the replica's model_info at the router")


def _events(serve: ServeProcess, **fields: Any) -> list[tuple[str, dict[str, Any]]]:
    """A streamed answer's events, in order."""
    answer = serve.http.post("/v1/images/generations", json={**BASE, "stream": True, **fields})
    assert answer.status_code == 200, answer.text
    out = []
    for chunk in answer.text.split("\n\n"):
        lines = dict(line.split(": ", 1) for line in chunk.splitlines() if ": " in line)
        if "data" in lines:
            out.append((lines.get("event", ""), json.loads(lines["data"])))
    return out


def _image(serve: ServeProcess, **fields: Any) -> bytes:
    answer = serve.http.post("/v1/images/generations", json={**BASE, **fields})
    assert answer.status_code == 200, answer.text
    return base64.b64decode(answer.json()["data"][0]["b64_json"])


def _previews_then_the_plain_image(serve: ServeProcess) -> None:
    events = _events(serve, partial_images=2)
    kinds = [kind.rsplit(".", 1)[-1] for kind, _ in events]
    assert kinds == ["partial_image", "partial_image", "completed"], kinds
    for _, event in events:
        with Image.open(io.BytesIO(base64.b64decode(event["b64_json"]))) as img:
            assert img.size == (64, 64)
    assert base64.b64decode(events[-1][1]["b64_json"]) == _image(serve)


@pytest.fixture(scope="module")
def flux2(flux2_model: Path) -> Iterator[ServeProcess]:
    with ServeProcess(flux2_model, 1, "--sp", "2", "--max-sequence-length", "32") as running:
        yield running


def test_flux2_under_sp_streams_previews_through_the_router(flux2: ServeProcess) -> None:
    assert _features(flux2)["partial_images"] > 0
    _previews_then_the_plain_image(flux2)


@pytest.fixture(scope="module")
def sd3(tiny_sd3_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    folder = tmp_path_factory.mktemp("models") / "sd3-clip31"
    shutil.copytree(tiny_sd3_model, folder)
    for name in ("tokenizer", "tokenizer_2"):
        config = folder / name / "tokenizer_config.json"
        config.write_text(json.dumps({**json.loads(config.read_text()), "model_max_length": CLIP}))
    # 31 CLIP + 33 T5 = 64 text tokens: the service's length splits over sp=2.
    with ServeProcess(folder, 1, "--sp", "2", "--max-sequence-length", "33") as running:
        yield running


def test_sd3_text_lengths_count_its_clip_tokens(sd3: ServeProcess) -> None:
    text = _features(sd3)["max_sequence_length"]
    assert text == {"max": 33, "multiple_of": 2, "prefix": CLIP}
    refused = sd3.http.post("/v1/images/generations", json={**BASE, "max_sequence_length": 32})
    assert refused.status_code == 400, refused.text
    named = {f["field"]: f["message"] for f in refused.json()["error"]["fields"]}
    message = named["max_sequence_length"]
    assert f"with the model's {CLIP} tokens ahead of it, a multiple of 2" in message, message
    assert f"({CLIP} + 32 = 63)" in message, message
    # 31 + 31 = 62 splits: served, and unlike the service's own length.
    assert _image(sd3, max_sequence_length=31) != _image(sd3)


def test_sd3_under_sp_streams_previews_through_the_router(sd3: ServeProcess) -> None:
    assert _features(sd3)["partial_images"] > 0
    _previews_then_the_plain_image(sd3)
