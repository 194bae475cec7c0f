"""Video generations on a real one-rank executor, in process (the tiny Wan-style model:
real WanPipeline, real PyAV): the mp4 and thumbnail, seeds, progress, a halt, the
refusals, what the replica reports, the warm-up and the cost it calibrates. The gang
loop and the ingress are not involved (test_video_gang.py runs a CFG gang)."""

from __future__ import annotations

import dataclasses
import io
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from PIL import Image

from dpserve.config.worker import WorkerConfig
from dpserve.contract import protocol as p
from dpserve.contract import video as v
from dpserve.contract.layout import ParallelConfig
from dpserve.worker.splittable import layout_problem
from tests.executors import one_rank_executors
from tests.workers import free_port

torch = pytest.importorskip("torch")
av = pytest.importorskip("av")

from dpserve.worker.boot import accel as _accel  # noqa: E402
from dpserve.worker.boot import warmup as _warmup  # noqa: E402
from dpserve.worker.executor import Executor  # noqa: E402
from dpserve.worker.features import video_support  # noqa: E402
from dpserve.worker.parallel import ParallelUnsupported  # noqa: E402

BASE: dict[str, Any] = dict(prompt="a cat", width=64, height=48, num_inference_steps=4, seed=[3])


@pytest.fixture(scope="module")
def executors(
    tiny_video_model: Path,
    tiny_model: Path,
    tiny_i2v_model: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Executor, Executor, Executor, WorkerConfig]]:
    """A video model's executor, an image model's and an image-to-video model's, on one
    one-rank gang; and the video model's config."""
    configs = [
        WorkerConfig(model=model, port=free_port(), device="cpu")
        for model in (tiny_video_model, tiny_model, tiny_i2v_model)
    ]
    with one_rank_executors(configs, tmp_path_factory.mktemp("gang")) as built:
        video, image, i2v = built
        yield video, image, i2v, configs[0]


@pytest.fixture()
def gang(executors: Any) -> tuple[Executor, Executor, WorkerConfig]:
    video, image, _, cfg = executors
    return video, image, cfg


def _params(frames: int = 17, fps: int = 16, **fields: Any) -> p.GenerateParams:
    spec = p.VideoSpec(num_frames=frames, fps=fps, seconds=(frames - 1) / fps)
    return p.GenerateParams(**{**BASE, **fields, "video": spec})


def _run(
    executor: Executor, params: p.GenerateParams, halt: Any = None, blobs: Sequence[bytes] = ()
) -> tuple[p.Message, list[v.VideoProgress]]:
    partials: list[list[bytes]] = []
    reply = p.decode(executor.generate("job", params, 0.25, halt, blobs, partials.append))
    progress = []
    for frames in partials:
        message = p.decode(frames)
        assert (message.kind, message.id) == (p.PARTIAL, "job")
        progress.append(message.body_as(v.VideoProgress))
    return reply, progress


def _decoded(mp4: bytes) -> tuple[np.ndarray, Any]:
    with av.open(io.BytesIO(mp4)) as container:
        stream = container.streams.video[0]
        rate = stream.average_rate
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    return np.stack(frames), rate


def test_a_video_is_an_mp4_of_its_frames_with_a_thumbnail(gang: Any) -> None:
    video, _, _ = gang
    reply, progress = _run(video, _params())
    assert reply.kind == p.RESULT, p.decode_error(reply) if reply.kind == p.ERROR else reply
    result = reply.body_as(v.VideoResult)
    assert (result.width, result.height, result.num_frames) == (64, 48, 17)
    assert (result.fps, result.seed, result.queue_time_s) == (16, 3, 0.25)
    assert result.inference_time_s > 0 and result.encode_time_s > 0
    assert result.peak_memory_mb >= 0
    mp4, jpeg = reply.blobs
    frames, rate = _decoded(mp4)
    assert frames.shape == (17, 48, 64, 3) and rate == 16
    assert frames.std() > 5  # not a flat video
    thumbnail = Image.open(io.BytesIO(jpeg))
    assert thumbnail.format == "JPEG" and thumbnail.size == (64, 48)
    first = np.asarray(thumbnail, dtype=np.int16)
    assert np.abs(first - frames[0].astype(np.int16)).mean() < 6  # the first frame
    # Progress after every denoising step, in order.
    assert [(s.step, s.steps) for s in progress] == [(1, 4), (2, 4), (3, 4), (4, 4)]


def test_the_same_seed_makes_the_same_bytes_and_another_seed_another_video(gang: Any) -> None:
    video, _, _ = gang
    first, _ = _run(video, _params(frames=9))
    again, _ = _run(video, _params(frames=9))
    other, _ = _run(video, _params(frames=9, seed=[4]))
    assert first.blobs == again.blobs
    assert other.blobs[0] != first.blobs[0] and other.blobs[1] != first.blobs[1]
    slower, _ = _run(video, _params(frames=9, fps=8))
    frames, rate = _decoded(slower.blobs[0])
    assert rate == 8 and len(frames) == 9  # (x264's rate control sees the rate too)


def test_a_halt_stops_the_video_at_that_step(gang: Any) -> None:
    video, _, _ = gang
    calls = {"n": 0}

    def halt() -> p.RequestError | None:
        calls["n"] += 1  # asked at every denoiser call: one a step without CFG
        return p.RequestError(p.CANCELLED, "the job was cancelled") if calls["n"] == 3 else None

    reply, progress = _run(video, _params(guidance_scale=1.0), halt)
    assert reply.kind == p.ERROR
    error = p.decode_error(reply)
    assert error.code == p.CANCELLED and "dropped at denoiser call 3" in str(error)
    assert [s.step for s in progress] == [1, 2]
    assert _run(video, _params(frames=5))[0].kind == p.RESULT  # and the next one runs


def test_images_and_videos_are_refused_by_the_other_kind_of_model(gang: Any) -> None:
    video, image, _ = gang
    on_video = p.decode_error(p.decode(video.generate("i", p.GenerateParams(**BASE), 0.0)))
    assert on_video.code == p.UNSUPPORTED and "makes videos" in str(on_video)
    on_image = p.decode_error(p.decode(image.generate("v", _params(), 0.0)))
    assert on_image.code == p.UNSUPPORTED and "not videos" in str(on_image)
    reference = _params(edit=p.EditInput(images=[0]))
    refused = p.decode_error(p.decode(video.generate("r", reference, 0.0, None, [b"x"])))
    assert refused.code == p.UNSUPPORTED and refused.fields[0].field == "input_reference"
    unresolved = msgspec.structs.replace(_params(), video=p.VideoSpec(seconds=2.0))
    error = p.decode_error(p.decode(video.generate("u", unresolved, 0.0)))
    assert error.code == p.INVALID_REQUEST and "fixed before" in str(error)


def test_the_replica_reports_a_video_models_frames(gang: Any) -> None:
    video, image, _ = gang
    assert msgspec.to_builtins(video.features.info())["video"] == {
        "max_frames": 129,
        "frame_factor": 4,
        "default_frames": 81,
        "default_fps": 16,
        "image_to_video": False,
        "text_to_video": True,
    }
    assert msgspec.to_builtins(image.features.info())["video"] is None
    assert video.ops.info is not None and video.ops.info.size_factor == 16
    assert video.ops.info.realtime != "supported"  # sessions are an image model's
    # --max-frames is rounded down to a count the VAE makes, and capped where the
    # transformer's rotary positions end (1024 latent frames).
    assert video_support(video.pipe, 20) == dataclasses.replace(
        video.features.video, max_frames=17, default_frames=17
    )
    assert video_support(video.pipe, 10**6).max_frames == 1023 * 4 + 1  # type: ignore[union-attr]
    assert video_support(image.pipe, 129) is None


def test_warm_up_makes_a_short_video_and_requests_calibrate_with_their_frames(
    gang: Any,
) -> None:
    video, _, cfg = gang
    _warmup(video, cfg)
    calibration = video.status.calibration
    assert calibration.report().samples == 0  # the warm-up is no sample
    short, long = _params(frames=5), _params(frames=17)
    assert calibration.units(long) == pytest.approx(5 / 2 * calibration.units(short))
    # Guidance CFG (the default 5.0) costs two branches; 1.0 one.
    assert calibration.units(_params(guidance_scale=1.0)) == pytest.approx(
        calibration.units(long) / 2
    )
    assert _run(video, long)[0].kind == p.RESULT
    report = calibration.report()
    assert report.samples == 1 and report.seconds_per_unit is not None
    assert (report.frame_factor, report.default_frames, report.default_guidance_scale) == (
        4,
        81,
        5.0,
    )
    assert (report.default_width, report.default_height, report.text_megapixels) == (
        832,
        480,
        0.0,
    )


def test_compile_and_step_caches_are_refused_for_video_but_sp_and_tp_are_not(
    gang: Any, tiny_video_model: Path, tmp_path: Path
) -> None:
    video, _, cfg = gang
    with pytest.raises(ParallelUnsupported, match="--compile is not verified on video"):
        _accel(dataclasses.replace(cfg, compile=True), video.pipe)
    with pytest.raises(ParallelUnsupported, match="not WanTransformer3DModel"):
        _accel(dataclasses.replace(cfg, step_cache="first_block_cache"), video.pipe)
    assert video.features.step_caches.offered == ()
    assert layout_problem(tiny_video_model, ParallelConfig(sp=2, ulysses=2), None) is None
    assert layout_problem(tiny_video_model, ParallelConfig(tp=2), None) is None
    # Another video denoiser has no plan: refused by name.
    other = tmp_path / "hunyuan"
    (other / "transformer").mkdir(parents=True)
    config = {"_class_name": "HunyuanVideoTransformer3DModel", "num_attention_heads": 24}
    (other / "transformer" / "config.json").write_text(json.dumps(config))
    problem = layout_problem(other, ParallelConfig(tp=2), None)
    assert problem is not None and "is HunyuanVideoTransformer3DModel" in problem


def _png(colour: tuple[int, int, int], size: tuple[int, int] = (80, 60)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="PNG")
    return buf.getvalue()


def test_an_image_to_video_model_animates_the_input_reference(executors: Any) -> None:
    _, _, i2v, cfg = executors
    support = msgspec.to_builtins(i2v.features.info())["video"]
    assert support["image_to_video"] and not support["text_to_video"]
    _warmup(i2v, cfg)  # animates a grey image
    reference = _params(frames=9, edit=p.EditInput(images=[0]))
    red, again = (_run(i2v, reference, None, [_png((220, 30, 30))])[0] for _ in range(2))
    blue, _ = _run(i2v, reference, None, [_png((30, 30, 220))])
    assert red.kind == p.RESULT and red.blobs == again.blobs
    assert blue.blobs[0] != red.blobs[0]  # the image reaches the video
    frames, _ = _decoded(red.blobs[0])
    assert frames.shape == (9, 48, 64, 3)  # the 80x60 image resized to the job's size
    error = p.decode_error(_run(i2v, _params(frames=9))[0])
    assert error.code == p.UNSUPPORTED and "input_reference is required" in str(error)
    bad = p.decode_error(_run(i2v, reference, None, [b"not an image"])[0])
    assert bad.code == p.INVALID_REQUEST and bad.fields[0].field == "input_reference"
