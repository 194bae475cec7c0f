"""Edits, previews, compression and features on a real one-rank executor, in process
(the tiny model; the gang loop and the ingress are not involved: see
test_gang_edit.py for those)."""

from __future__ import annotations

import io
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from PIL import Image

from dpserve.config.worker import WorkerConfig
from dpserve.contract import protocol as p
from dpserve.contract import validation as pv
from tests.executors import one_rank_executors, reply_to
from tests.workers import free_port

torch = pytest.importorskip("torch")

from dpserve.worker.executor import Executor  # noqa: E402

BASE = dict(prompt="a red fox", width=64, height=64, num_inference_steps=4, seed=[5])


@pytest.fixture(scope="module")
def executor(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Executor]:
    cfg = WorkerConfig(model=tiny_model, port=free_port(), device="cpu")
    with one_rank_executors([cfg], tmp_path_factory.mktemp("gang")) as (built,):
        yield built


def _run(
    executor: Executor, blobs: Sequence[bytes] = (), **fields: Any
) -> tuple[p.Message, list[p.Message]]:
    partials: list[list[bytes]] = []
    reply = reply_to(executor, {**BASE, **fields}, blobs, partials.append)
    return reply, [p.decode(f) for f in partials]


def _png(colour: tuple[int, int, int], size: tuple[int, int] = (64, 64)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="PNG")
    return buf.getvalue()


def _mask(size: tuple[int, int] = (64, 64)) -> bytes:
    img = Image.new("L", size, 0)
    img.paste(255, (0, 0, size[0] // 2, size[1]))  # repaint the left half
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _pixels(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"), dtype=np.int16)


def test_features_say_what_the_tiny_flux_serves(executor: Executor) -> None:
    assert msgspec.to_builtins(executor.ops.info)["features"] == {
        "edits": True,
        "inpainting": True,
        "max_edit_images": 1,
        "partial_images": pv.MAX_PARTIAL_IMAGES,
        "output_formats": ["png", "jpeg", "webp"],
        "output_compression": True,
        "max_n": 10,
        "step_caches": {"first_block_cache": {"threshold": 0.08}, "taylorseer": {"interval": 3}},
        "step_cache_default": None,
        "max_sequence_length": {"max": 512, "multiple_of": 1},
        "flow_shift": {"default": None},  # Flux shifts by the image size
        "vae_tiling": True,
        "vae_slicing": True,
        "video": None,  # an image model
    }


def test_image_to_image_edits_are_deterministic_and_start_from_the_image(
    executor: Executor,
) -> None:
    plain, _ = _run(executor)
    red = _png((230, 30, 30), (100, 70))
    edit = p.EditInput(images=[0], strength=0.75)
    one, _ = _run(executor, [red], edit=edit, width=None, height=None)
    again, _ = _run(executor, [red], edit=edit, width=None, height=None)
    assert one.blobs == again.blobs  # same seed, same bytes
    meta = one.body_as(p.GenerateResult).images[0]
    assert (meta.width, meta.height) == (96, 64)  # the image's size, down to the multiple of 16
    assert _pixels(one.blobs[0]).shape == (64, 96, 3)
    blue, _ = _run(executor, [_png((30, 30, 230))], edit=edit)
    assert blue.blobs[0] != plain.blobs[0]
    # The image drives the result: the red start stays redder than the blue one.
    red64, _ = _run(executor, [_png((230, 30, 30))], edit=edit)
    r, b = _pixels(red64.blobs[0]).mean((0, 1)), _pixels(blue.blobs[0]).mean((0, 1))
    assert r[0] - r[2] > b[0] - b[2]


def test_inpainting_repaints_under_the_mask_with_n_images(executor: Executor) -> None:
    image, mask = _png((40, 200, 40)), _mask()
    edit = p.EditInput(images=[0], mask=1, strength=1.0)
    two, _ = _run(executor, [image, mask], edit=edit, n=2, seed=[1, 2])
    again, _ = _run(executor, [image, mask], edit=edit, n=2, seed=[1, 2])
    assert len(two.blobs) == 2 and two.blobs == again.blobs and two.blobs[0] != two.blobs[1]
    assert all(_pixels(b).shape == (64, 64, 3) for b in two.blobs)
    plain, _ = _run(executor, n=2, seed=[1, 2])
    assert two.blobs[0] != plain.blobs[0]


def test_an_edit_the_pipeline_cannot_take_is_refused(executor: Executor) -> None:
    with pytest.raises(p.RequestError, match="takes one image") as err:
        _run(executor, [_png((1, 2, 3)), _png((3, 2, 1))], edit=p.EditInput(images=[0, 1]))
    assert err.value.code == p.UNSUPPORTED
    with pytest.raises(p.RequestError, match="no denoising step"):
        _run(executor, [_png((1, 2, 3))], edit=p.EditInput(images=[0], strength=0.1))


def test_previews_come_before_the_result_and_change_nothing(executor: Executor) -> None:
    plain, none = _run(executor, n=2, seed=[3, 4])
    assert none == []
    result, partials = _run(executor, n=2, seed=[3, 4], partial_images=2)
    assert result.blobs == plain.blobs  # the same bytes as without previews
    bodies = [m.body_as(p.PartialImage) for m in partials]
    assert all(m.kind == p.PARTIAL and m.id == "r" for m in partials)
    assert [(b.image, b.index, b.step, b.steps) for b in bodies] == [
        (0, 0, 1, 4), (1, 0, 1, 4), (0, 1, 3, 4), (1, 1, 3, 4)
    ]  # fmt: skip
    for message, body in zip(partials, bodies, strict=True):
        assert _pixels(message.blobs[body.blob]).shape == (64, 64, 3)
        assert (body.width, body.height, body.format) == (64, 64, "png")
    # A later preview is nearer the final image than an earlier one.
    final = _pixels(result.blobs[0])
    early, late = (_pixels(partials[i].blobs[0]) for i in (0, 2))
    assert np.abs(late - final).mean() < np.abs(early - final).mean()


def test_previews_of_an_edit_in_the_requested_format(executor: Executor) -> None:
    edit = p.EditInput(images=[0], strength=0.75)  # 3 of 4 steps run
    result, partials = _run(
        executor, [_png((200, 90, 10))], edit=edit, partial_images=1, output_format="webp"
    )
    (body,) = [m.body_as(p.PartialImage) for m in partials]
    assert (body.step, body.steps, body.format) == (2, 3, "webp")
    assert Image.open(io.BytesIO(partials[0].blobs[0])).format == "WEBP"
    plain, _ = _run(executor, [_png((200, 90, 10))], edit=edit, output_format="webp")
    assert plain.blobs == result.blobs


def test_compression_shrinks_files_and_encode_time_is_reported(executor: Executor) -> None:
    for fmt in ("jpeg", "webp"):
        full, _ = _run(executor, output_format=fmt)
        small, _ = _run(executor, output_format=fmt, output_compression=20)
        assert len(small.blobs[0]) < len(full.blobs[0])
        timing = small.body_as(p.GenerateResult)
        assert 0 < timing.encode_time_s < timing.inference_time_s + 1


def test_preview_cost_against_a_step(
    executor: Executor, capsys: pytest.CaptureFixture[str]
) -> None:
    """Measured, printed with -s: a 64x64 preview (x0, VAE decode, PNG) vs a step."""
    steps = 8
    start = time.perf_counter()
    _run(executor, num_inference_steps=steps)
    plain = time.perf_counter() - start
    start = time.perf_counter()
    _run(executor, num_inference_steps=steps, partial_images=3)
    with_previews = time.perf_counter() - start
    with capsys.disabled():
        print(
            f"\n64x64 step {plain / steps * 1000:.1f} ms; "
            f"preview {(with_previews - plain) / 3 * 1000:.1f} ms each"
        )
