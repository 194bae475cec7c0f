"""Typed requests are checked with the bounds their dict parsers give a body: the same
answer, the same error (message and fields), without encoding a struct back to a dict."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from dpserve.contract import protocol as p
from dpserve.contract import realtime as rt
from dpserve.contract import validation as pv
from dpserve.contract import video as v

LIMITS = pv.Limits(max_side=256, size_factor=16, max_steps=50, sequence_split=2, max_frames=33)


def _outcome(call: Any) -> Any:
    try:
        return call()
    except p.RequestError as exc:
        return (exc.code, str(exc), exc.fields)


def _job_body(params: p.GenerateParams) -> dict[str, Any]:
    """The body parse_video would read for a job's typed params."""
    spec = params.video
    assert spec is not None
    fields = {
        "prompt": params.prompt,
        "negative_prompt": params.negative_prompt,
        "width": params.width,
        "height": params.height,
        "num_inference_steps": params.num_inference_steps,
        "guidance_scale": params.guidance_scale,
        "seed": params.seed[0] if params.seed else None,
        "num_frames": spec.num_frames,
        "seconds": spec.seconds if spec.num_frames is None else None,
        "fps": spec.fps,
    }
    return {k: value for k, value in fields.items() if value is not None}


JOBS = [
    {"width": 64, "height": 64, "seed": [3], "video": p.VideoSpec(seconds=1.0)},
    {"width": 64, "height": 64, "video": p.VideoSpec(num_frames=9, fps=8)},
    {"width": 65, "height": 4096, "num_inference_steps": 0, "video": p.VideoSpec()},
    {"width": 48, "height": 16, "guidance_scale": 101.0, "video": p.VideoSpec(fps=61)},
    {"width": 64, "height": 64, "seed": [2**63], "video": p.VideoSpec(seconds=700.0)},
    {"width": 64, "height": 64, "video": p.VideoSpec(num_frames=10)},
    {"width": 64, "height": 64, "video": p.VideoSpec(num_frames=100_001)},
    {"prompt": "x" * 10_001, "negative_prompt": "y" * 10_001, "video": p.VideoSpec()},
    {"edit": p.EditInput(images=[0]), "n": 3, "output_format": "jpeg", "video": p.VideoSpec()},
]


@pytest.mark.parametrize("fields", JOBS)
def test_a_typed_job_is_checked_as_its_body_would_be(fields: dict[str, Any]) -> None:
    params = p.GenerateParams(**{"prompt": "a cat", **fields})
    blobs = 1 if params.edit is not None else 0
    parsed = _outcome(lambda: v.parse_video(_job_body(params), LIMITS, blobs=blobs))
    assert _outcome(lambda: v.check_job(params, LIMITS)) == parsed


SESSIONS = [
    {},
    {"width": 64, "height": 48, "seed": 2**63, "output_format": "gif"},
    {"width": 65, "num_inference_steps": 51, "guidance_scale": -1.0, "true_cfg_scale": 101.0},
    {"width": 48, "height": 16},  # 3 tokens over 2 sequence-parallel ranks
    {"prompt": "x" * 10_001},
    {"frame_steps": 51},
    {"strength": 0.0},
]


@pytest.mark.parametrize("fields", SESSIONS)
def test_typed_session_params_get_a_generations_bounds(fields: dict[str, Any]) -> None:
    params = rt.SessionParams(**{"prompt": "a road", **fields})

    def parsed() -> None:  # what a generation with the same fields is told
        shared = ("prompt", "negative_prompt", "width", "height", "num_inference_steps")
        shared += ("guidance_scale", "true_cfg_scale", "seed", "output_format")
        body = {k: getattr(params, k) for k in shared if getattr(params, k) is not None}
        pv.parse_generate(body, LIMITS)
        if not 1 <= params.frame_steps <= LIMITS.max_steps or not 0 < params.strength <= 1:
            raise p.RequestError(
                p.INVALID_REQUEST,
                f"frame_steps must be 1..{LIMITS.max_steps} and strength in (0, 1]",
            )

    assert _outcome(lambda: rt.check_session(params, LIMITS)) == _outcome(parsed)


@pytest.mark.parametrize("size", [(64, 64), (16, 48), (8, 64), (48, 16), (272, 64)])
def test_a_chosen_size_meets_the_bounds_a_given_one_does(size: tuple[int, int]) -> None:
    width, height = size
    given = _outcome(
        lambda: pv.parse_generate({"prompt": "a", "width": width, "height": height}, LIMITS)
    )
    checked = _outcome(lambda: pv.check_size(width, height, LIMITS))
    if isinstance(given, p.GenerateParams):
        assert checked is None
    else:
        assert checked == given


def test_a_typed_job_keeps_only_what_a_video_job_takes() -> None:
    asked = p.GenerateParams(prompt="a cat", n=2, output_format="webp", partial_images=2,
                             width=64, height=64, video=p.VideoSpec(seconds=1.0))  # fmt: skip
    job = v.check_job(asked, LIMITS)
    assert (job.n, job.output_format, job.partial_images) == (1, "png", 0)
    assert job.video == p.VideoSpec(num_frames=17, seconds=1.0, fps=16)
    assert msgspec.structs.replace(job, video=None) == p.GenerateParams(
        prompt="a cat", width=64, height=64
    )
