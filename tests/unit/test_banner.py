"""`dpserve serve`'s banner shows calls that fit the model it serves (the e2e tests in
tests/e2e/test_serve_startup.py run them against real servers)."""

from __future__ import annotations

from dpserve.banner import ModelFacts, Ready, banner
from dpserve.contract.model_info import ModelInfo, decode
from tests.stub_replica import FEATURES, model_info

READY = Ready("http://127.0.0.1:8000", 2, "/m", ["tcp://127.0.0.1:5575"], False, 12.34)
IMAGE_INFO = decode({**model_info(), "realtime": "supported", "size_factor": 16})
VIDEO = {
    "max_frames": 129,
    "frame_factor": 4,
    "default_frames": 81,
    "default_fps": 16,
    "text_to_video": True,
    "image_to_video": False,
}


def _video_info(video: dict[str, object], **changes: object) -> ModelInfo:
    return decode({**model_info(), "features": {**FEATURES, "video": video}, **changes})


def test_an_image_model_shows_a_generation_and_realtime() -> None:
    text = banner(READY, ModelFacts.of(IMAGE_INFO))
    assert "dpserve ready in 12.3s: 2 replica(s) of /m behind http://127.0.0.1:8000" in text
    assert "curl -s http://127.0.0.1:8000/v1/images/generations" in text
    assert "ws://127.0.0.1:8000/v1/realtime_video/generate" in text
    assert "/v1/videos" not in text


def test_a_video_model_shows_its_job_calls_and_no_image_call() -> None:
    info = _video_info(VIDEO, realtime="unsupported: no", size_factor=16)
    text = banner(READY, ModelFacts.of(info))
    assert "/v1/images" not in text and "realtime" not in text
    assert "curl -s http://127.0.0.1:8000/v1/videos -H 'Content-Type: application/json'" in text
    assert '"size": "64x48", "seconds": "1"' in text
    assert "/v1/videos/VIDEO_ID/content -o video.mp4" in text


def test_an_image_to_video_model_sends_an_image() -> None:
    video = {**VIDEO, "text_to_video": False, "image_to_video": True}
    text = banner(READY, ModelFacts.of(_video_info(video, size_factor=32)))
    assert "-F size=128x96" in text and "-F input_reference=@YOUR_IMAGE.png" in text
    assert "application/json" not in text


def test_keys_are_named_never_shown_and_an_unknown_model_gets_the_models_call() -> None:
    keyed = Ready(READY.url, 1, "/m", READY.endpoints, True, 1.0)
    text = banner(keyed, ModelFacts())
    models = "curl -s http://127.0.0.1:8000/v1/models -H 'Authorization: Bearer <your --api-key>'"
    assert models in text
    assert "<your --admin-key>" in text and "/v1/images" not in text
