"""Per-request call settings on a real one-rank executor in process (the tiny Flux
model): the text length, the scheduler's shift and the VAE's decoding change the
image as documented (worker/call_settings.py) and leave the pipeline as it was.
Through the router and a real worker: tests/e2e/test_request_fields.py."""

from __future__ import annotations

import io
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from PIL import Image

from dpserve.config.worker import WorkerConfig
from dpserve.contract import protocol as p
from dpserve.contract.model_info import TextLength
from tests.executors import one_rank_executors, reply_to
from tests.pixels import psnr_db
from tests.workers import free_port

torch = pytest.importorskip("torch")

from dpserve.worker.executor import Executor  # noqa: E402

BASE = dict(prompt="a red fox", width=64, height=64, num_inference_steps=4, seed=[5])


@pytest.fixture(scope="module")
def executor(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Executor]:
    config = WorkerConfig(model=tiny_model, port=free_port(), device="cpu")
    with one_rank_executors((config,), tmp_path_factory.mktemp("gang")) as built:
        yield built[0]


def _images(executor: Executor, **fields: Any) -> list[bytes]:
    return list(reply_to(executor, {**BASE, **fields}).blobs)


def _image(executor: Executor, **fields: Any) -> bytes:
    return _images(executor, **fields)[0]


def size_shift(executor: Executor, width: int, height: int) -> float:
    """The shift Flux's dynamic shifting computes for this size: e**mu."""
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    config = executor.pipe.scheduler.config
    tokens = (width // 16) * (height // 16)
    mu = calculate_shift(
        tokens,
        config.base_image_seq_len,
        config.max_image_seq_len,
        config.base_shift,
        config.max_shift,
    )
    return math.exp(mu)


def test_the_features_say_what_a_request_may_set(executor: Executor) -> None:
    features = msgspec.to_builtins(executor.ops.info)["features"]
    assert features["max_sequence_length"] == {"max": 512, "multiple_of": 1}
    assert features["flow_shift"] == {"default": None}  # Flux shifts by the image size
    assert features["vae_tiling"] is True and features["vae_slicing"] is True


def test_the_text_length_changes_the_image_and_the_default_is_the_pipelines(
    executor: Executor,
) -> None:
    plain = _image(executor)
    assert _image(executor, max_sequence_length=512) == plain
    short = _image(executor, max_sequence_length=64)
    assert short != plain and _image(executor, max_sequence_length=64) == short


def test_a_flow_shift_replaces_the_size_shift_and_the_scheduler_comes_back(
    executor: Executor,
) -> None:
    scheduler = executor.pipe.scheduler
    plain = _image(executor)
    # Flux's dynamic shift at 64x64 is e**mu: given as a fixed shift, the same schedule
    # up to float rounding (the two formulas round differently).
    assert psnr_db(_image(executor, flow_shift=size_shift(executor, 64, 64)), plain) > 70
    shifted = _image(executor, flow_shift=3.0)
    assert psnr_db(shifted, plain) < 60 and _image(executor, flow_shift=3.0) == shifted
    assert executor.pipe.scheduler is scheduler and scheduler.config.use_dynamic_shifting
    assert _image(executor) == plain


def test_previews_follow_the_shifted_schedule(executor: Executor) -> None:
    sent: list[list[bytes]] = []
    reply = reply_to(executor, {**BASE, "partial_images": 2, "flow_shift": 3.0}, emit=sent.append)
    assert len(sent) == 2 and reply.blobs[0] == _image(executor, flow_shift=3.0)


def test_vae_tiling_and_slicing_decode_valid_images_and_are_undone(executor: Executor) -> None:
    vae = executor.pipe.vae
    plain = _image(executor)
    tiled = _image(executor, vae_use_tiling=True)
    assert tiled != plain  # the tiny VAE tiles from 32 px: the seams' blending shows
    with Image.open(io.BytesIO(tiled)) as img:
        assert img.size == (64, 64) and img.format == "PNG"
    two = dict(n=2, seed=[5, 6])
    sliced = _images(executor, vae_use_slicing=True, **two)
    assert len(sliced) == 2 and all(Image.open(io.BytesIO(b)).size == (64, 64) for b in sliced)
    assert not vae.use_tiling and not vae.use_slicing
    assert _image(executor) == plain


def test_what_the_pipeline_lacks_is_refused_by_name() -> None:
    from dpserve.worker.call_settings import CallSettings

    bare = CallSettings()
    params = p.GenerateParams(
        prompt="x", max_sequence_length=8, flow_shift=2.0, vae_use_tiling=True, vae_use_slicing=True
    )
    with pytest.raises(p.RequestError) as err:
        bare.check(params)
    assert err.value.code == p.UNSUPPORTED
    assert [e.field for e in err.value.fields] == [
        "max_sequence_length",
        "flow_shift",
        "vae_use_tiling",
        "vae_use_slicing",
    ]
    split = CallSettings(text_length=512, text_multiple=4)
    with pytest.raises(p.RequestError, match="at most 512, a multiple of 4"):
        split.check(p.GenerateParams(prompt="x", max_sequence_length=66))
    with pytest.raises(p.RequestError, match="at most 512"):
        split.check(p.GenerateParams(prompt="x", max_sequence_length=1024))
    split.check(p.GenerateParams(prompt="x", max_sequence_length=64))


def test_sd3_s_text_length_counts_the_clip_tokens_ahead_of_it() -> None:
    """SD3's joint text is its CLIP prompt (77 tokens for the real models) and then the
    request's T5 tokens; a split cuts the two together, so the sum must divide."""
    from dpserve.worker.call_settings import CallSettings
    from dpserve.worker.splittable import text_prefix

    assert text_prefix("SD3Transformer2DModel", 77) == 77
    assert text_prefix("FluxTransformer2DModel", 77) == 0  # no CLIP tokens in its text
    sd3 = CallSettings(text_length=255, text_multiple=2, text_prefix=77)
    sd3.check(p.GenerateParams(prompt="x", max_sequence_length=127))  # 77 + 127 = 204
    with pytest.raises(p.RequestError) as err:
        sd3.check(p.GenerateParams(prompt="x", max_sequence_length=128))  # even, yet 205
    (field,) = err.value.fields
    assert field.field == "max_sequence_length"
    assert "with the model's 77 tokens ahead of it, a multiple of 2" in field.message
    assert "got 128 (77 + 128 = 205)" in field.message
    assert sd3.text_offer() == TextLength(max=255, multiple_of=2, prefix=77)
    assert msgspec.to_builtins(CallSettings(text_length=8).text_offer()) == {
        "max": 8,
        "multiple_of": 1,
    }  # no prefix where there is none


def test_which_schedulers_have_a_shift_and_how_a_request_sets_it() -> None:
    from diffusers import (
        DDIMScheduler,
        FlowMatchEulerDiscreteScheduler,
        UniPCMultistepScheduler,
    )

    from dpserve.worker.call_settings import shift_of, shifted

    dynamic = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True)
    assert shift_of(dynamic) == ("shift", None)  # by image size
    assert shift_of(FlowMatchEulerDiscreteScheduler(shift=5.0)) == ("shift", 5.0)
    wan = UniPCMultistepScheduler(
        use_flow_sigmas=True, flow_shift=3.0, prediction_type="flow_prediction"
    )
    assert shift_of(wan) == ("flow_shift", 3.0)
    assert shift_of(DDIMScheduler()) == (None, None)
    assert shift_of(UniPCMultistepScheduler()) == (None, None)  # not on flow sigmas
    fixed = shifted(dynamic, "shift", 2.0)
    assert type(fixed) is type(dynamic) and fixed.shift == 2.0
    assert not fixed.config.use_dynamic_shifting and dynamic.config.use_dynamic_shifting
    assert shifted(wan, "flow_shift", 7.0).config.flow_shift == 7.0
