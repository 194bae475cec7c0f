"""The worker's video pieces as pure code: mp4 and thumbnail encoding (real PyAV and
libx264), the cost of frames, the CFG rule of guidance-CFG pipelines, batching, the
pipeline arguments and the refusals."""

from __future__ import annotations

import io

import msgspec
import numpy as np
import pytest

from dpserve.contract import protocol as p
from dpserve.contract.cost import cfg_branches, cost_units, latent_frames
from dpserve.contract.model_info import decode
from dpserve.worker.batch import Batching, batchable, compatible
from dpserve.worker.commands import GangCommand, Generation

av = pytest.importorskip("av")
torch = pytest.importorskip("torch")

from PIL import Image  # noqa: E402

from dpserve.worker.features import VideoSupport  # noqa: E402
from dpserve.worker.pipeline import cfg_requested  # noqa: E402
from dpserve.worker.video_call import refusal, video_kwargs  # noqa: E402
from dpserve.worker.video_encode import encode_mp4, encode_thumbnail, to_uint8  # noqa: E402
from tests.stub_replica import FEATURES, model_info  # noqa: E402

WAN_ARGS = {"negative_prompt": None, "width": 832, "height": 480, "num_frames": 81,
            "num_inference_steps": 50, "guidance_scale": 5.0}  # fmt: skip
FLUX_ARGS = {"negative_prompt": None, "true_cfg_scale": 1.0, "width": None, "height": None,
             "num_inference_steps": 28, "guidance_scale": 3.5}  # fmt: skip
WAN_COST = p.CostReport(
    default_width=832,
    default_height=480,
    default_steps=50,
    default_guidance_scale=5.0,
    frame_factor=4,
    default_frames=81,
)
SUPPORT = VideoSupport(max_frames=129, frame_factor=4, default_frames=81)


def _video(frames: int | None = 17, **kw: object) -> p.GenerateParams:
    fields: dict[str, object] = {"prompt": "a cat", "seed": [3], **kw}
    return p.GenerateParams(video=p.VideoSpec(num_frames=frames, fps=16), **fields)  # type: ignore[arg-type]


def _moving(count: int = 9, height: int = 48, width: int = 64) -> np.ndarray:
    """Smooth gradients sliding sideways: float frames in [0, 1] as a pipeline gives."""
    y, x = np.mgrid[0:height, 0:width]
    frames = [
        np.stack([(x + 3 * t) / width, y / height, np.full(x.shape, 0.5)], -1) for t in range(count)
    ]
    return np.clip(np.stack(frames), 0.0, 1.0).astype(np.float32)


# ---------------------------------------------------------------- encoding


def test_mp4_is_h264_yuv420p_with_every_frame_at_the_rate() -> None:
    pixels = to_uint8(_moving())
    mp4 = encode_mp4(pixels, 16)
    assert mp4[4:8] == b"ftyp" and mp4.find(b"moov") < mp4.find(b"mdat")  # faststart
    with av.open(io.BytesIO(mp4)) as container:
        stream = container.streams.video[0]
        assert stream.codec_context.name == "h264"
        assert stream.codec_context.pix_fmt == "yuv420p"
        assert (stream.width, stream.height, stream.average_rate) == (64, 48, 16)
        decoded = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
    assert decoded.shape == (9, 48, 64, 3)
    # Lossy, but near: smooth frames come back within a few grey levels on average.
    assert np.abs(decoded.astype(int) - pixels.astype(int)).mean() < 4


def test_the_same_frames_make_the_same_bytes_and_others_do_not() -> None:
    pixels = to_uint8(_moving())
    mp4 = encode_mp4(pixels, 16)
    assert encode_mp4(pixels.copy(), 16) == mp4
    assert encode_mp4(pixels[::-1].copy(), 16) != mp4
    assert encode_mp4(pixels, 24) != mp4


def test_noisy_frames_encode_to_one_file_every_time() -> None:
    """x264's macroblock tree made several files of these now and then (video_encode.py)."""
    rng = np.random.default_rng(0)
    noisy = np.clip(_moving() + rng.normal(0, 0.08, _moving().shape), 0, 1)
    pixels = to_uint8(noisy.astype(np.float32))
    assert len({encode_mp4(pixels, 16) for _ in range(40)}) == 1


def test_frames_an_mp4_cannot_hold_are_refused() -> None:
    with pytest.raises(ValueError, match="even sides"):
        encode_mp4(to_uint8(_moving(width=63)), 16)
    with pytest.raises(ValueError, match="F x H x W x 3"):
        to_uint8(np.zeros((4, 4, 3), dtype=np.float32))


def test_to_uint8_rounds_and_clips() -> None:
    frames = np.array([-0.1, 0.0, 0.5, 1.0, 1.2], dtype=np.float32).reshape(1, 1, 5, 1)
    got = to_uint8(np.repeat(frames, 3, axis=-1))[0, 0, :, 0]
    assert got.tolist() == [0, 0, 128, 255, 255]


def test_thumbnail_is_a_jpeg_of_the_first_frame() -> None:
    pixels = to_uint8(_moving())
    image = Image.open(io.BytesIO(encode_thumbnail(pixels)))
    assert image.format == "JPEG" and image.size == (64, 48)
    assert np.abs(np.asarray(image, dtype=int) - pixels[0].astype(int)).mean() < 3


# ---------------------------------------------------------------- cost and CFG


def test_a_video_costs_its_latent_frames_times_a_frame() -> None:
    assert latent_frames(p.GenerateParams(prompt="x"), WAN_COST) == 1
    assert latent_frames(_video(1), WAN_COST) == 1
    assert latent_frames(_video(17), WAN_COST) == 5
    assert latent_frames(_video(None), WAN_COST) == 21  # the default 81 frames
    frame = cost_units(p.GenerateParams(prompt="x", width=64, height=48), WAN_COST)
    assert cost_units(_video(17, width=64, height=48), WAN_COST) == pytest.approx(5 * frame)


def test_guidance_cfg_needs_only_a_scale_above_one() -> None:
    # Wan: guidance_scale is CFG, on at its default 5, a negative prompt or not.
    assert cfg_branches(_video(), WAN_COST) == 2
    assert cfg_branches(_video(guidance_scale=1.0), WAN_COST) == 1
    assert cfg_requested(_video(), WAN_ARGS, by_guidance=True)
    assert not cfg_requested(_video(guidance_scale=1.0), WAN_ARGS, by_guidance=True)
    assert cfg_requested(_video(guidance_scale=2.0, negative_prompt="x"), WAN_ARGS, True)
    # Flux: guidance_scale is an embedding; CFG is true_cfg_scale with a negative prompt.
    flux = p.GenerateParams(prompt="a", guidance_scale=7.0)
    assert not cfg_requested(flux, FLUX_ARGS) and cfg_branches(flux, p.CostReport()) == 1
    on = p.GenerateParams(prompt="a", negative_prompt="b", true_cfg_scale=1.5)
    assert cfg_requested(on, FLUX_ARGS)


# ---------------------------------------------------------------- batching


def test_videos_never_share_a_call() -> None:
    assert not batchable(_video())
    assert not compatible(_video(), _video())
    assert not compatible(p.GenerateParams(prompt="x"), _video())
    command = GangCommand(kind=p.GENERATE, id="j", batch=[Generation(id="j", params=_video())])
    assert not Batching(max_images=4).grows(command)


# ---------------------------------------------------------------- arguments and refusals


def test_video_kwargs_one_generator_the_frames_and_no_image_count() -> None:
    kwargs = video_kwargs(_video(17, width=64, height=48, num_inference_steps=4), WAN_ARGS, "np")
    generator = kwargs.pop("generator")
    assert isinstance(generator, torch.Generator) and generator.initial_seed() == 3
    assert generator.device.type == "cpu"
    assert kwargs == {
        "prompt": "a cat",
        "output_type": "np",
        "width": 64,
        "height": 48,
        "num_inference_steps": 4,
        "num_frames": 17,
    }


@pytest.mark.parametrize(
    ("params", "code", "words"),
    [
        (_video(None), p.INVALID_REQUEST, "frames must be fixed"),
        (_video(n=2, seed=[1, 2]), p.INVALID_REQUEST, "one video"),
        (_video(true_cfg_scale=3.0), p.UNSUPPORTED, "true_cfg_scale"),
    ],
)
def test_video_kwargs_refuses_what_a_video_call_cannot_take(
    params: p.GenerateParams, code: str, words: str
) -> None:
    with pytest.raises(p.RequestError, match=words) as err:
        video_kwargs(params, WAN_ARGS, "np")
    assert err.value.code == code


def test_images_and_videos_go_only_to_their_models() -> None:
    image = p.GenerateParams(prompt="x", seed=[1])
    assert refusal(image, None) is None and refusal(_video(), SUPPORT) is None
    on_video_model = refusal(image, SUPPORT)
    assert on_video_model is not None and on_video_model.code == p.UNSUPPORTED
    assert "POST /v1/videos" in str(on_video_model)
    on_image_model = refusal(_video(), None)
    assert on_image_model is not None and on_image_model.code == p.UNSUPPORTED
    assert "not videos" in str(on_image_model)
    with_reference = _video(edit=p.EditInput(images=[0]))
    error = refusal(with_reference, SUPPORT)
    assert error is not None and error.code == p.UNSUPPORTED
    assert [f.field for f in error.fields] == ["input_reference"]
    animator = VideoSupport(
        max_frames=129, frame_factor=4, default_frames=81, image_to_video=True, text_to_video=False
    )
    assert refusal(with_reference, animator) is None
    needed = refusal(_video(), animator)
    assert needed is not None and needed.code == p.UNSUPPORTED and "required" in str(needed)


def test_limits_carry_a_video_models_frames() -> None:
    video = msgspec.to_builtins(SUPPORT.info())
    info = decode({**model_info(), "max_side": 512, "features": {**FEATURES, "video": video}})
    limits = info.limits()
    assert (limits.max_frames, limits.frame_factor, limits.default_frames) == (129, 4, 81)
    assert limits.default_fps == 16 and limits.max_side == 512
    assert decode(model_info()).limits().max_frames == 0  # no videos
    assert video == {
        "max_frames": 129,
        "frame_factor": 4,
        "default_frames": 81,
        "default_fps": 16,
        "image_to_video": False,
        "text_to_video": True,
    }
