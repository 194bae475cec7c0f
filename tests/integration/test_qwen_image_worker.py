"""Qwen-Image through the worker's ZMQ front: one rank, and split (tp2, ulysses2, cfg2) against it:
images, edits, previews, batches, LoRA (the service's and a request's own) and weight
updates."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from dpserve.client import ReplicaClient
from dpserve.contract import protocol as p
from tests.workers import WorkerProcess

pytestmark = pytest.mark.gang

REQUEST = dict(
    prompt="a red fox in snow",
    negative_prompt="ugly blurry",
    true_cfg_scale=4.0,
    width=64,
    height=64,
    num_inference_steps=3,
    seed=[21],
)


def _pixels(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png))).astype(np.int16)


def _close(a: bytes, b: bytes) -> bool:
    return int(np.abs(_pixels(a) - _pixels(b)).max()) <= 1


def _png(worker: WorkerProcess, **fields: object) -> bytes:
    with worker.client() as c:
        return c.generate(**{**REQUEST, **fields})[1][0]


BATCH = ("--max-batch", "4")


@pytest.fixture(scope="module")
def single(tiny_qwen_model: Path, allow_tmp: tuple[str, str]) -> Iterator[WorkerProcess]:
    with WorkerProcess(tiny_qwen_model, *BATCH, *allow_tmp) as w:
        yield w


def test_one_rank_serves_qwen_image(single: WorkerProcess) -> None:
    a, b = _png(single), _png(single, prompt="a blue car")
    assert _pixels(a).shape == (64, 64, 3) and a != b


LAYOUTS = {"tp2": ("--tp", "2"), "ulysses2": ("--sp", "2"), "cfg2": ("--cfg", "2")}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def split(
    request: pytest.FixtureRequest, tiny_qwen_model: Path, allow_tmp: tuple[str, str]
) -> Iterator[WorkerProcess]:
    with WorkerProcess(tiny_qwen_model, *LAYOUTS[request.param], *BATCH, *allow_tmp) as w:
        yield w


def test_images_match_one_rank(single: WorkerProcess, split: WorkerProcess) -> None:
    # True CFG, none (a cfg-free call), and a wider image (more tokens).
    for fields in ({}, {"negative_prompt": None, "true_cfg_scale": None}, {"width": 128}):
        assert _close(_png(split, **fields), _png(single, **fields)), fields


def test_a_cfg2_gang_draws_one_rank_s_bytes(
    single: WorkerProcess, tiny_qwen_model: Path, allow_tmp: tuple[str, str]
) -> None:
    """Each CFG rank runs one branch's exact forward on the text the output rank's
    Qwen2.5-VL encoded and relayed (its last hidden state only, the one the pipeline
    reads: parallel/encoder_reads.py), so the images are one rank's bytes."""
    with WorkerProcess(tiny_qwen_model, "--cfg", "2", *allow_tmp) as cfg2:
        for fields in ({}, {"width": 128, "prompt": "a blue car"}):
            assert _png(cfg2, **fields) == _png(single, **fields), fields


def test_each_rank_holds_its_share_of_the_transformer(
    single: WorkerProcess, split: WorkerProcess
) -> None:
    with single.client() as c:
        whole = c.control("model_info")["rank_weights"][0]["bytes"]["transformer"]
    with split.client() as c:
        info = c.control("model_info")
    pieces = [w["bytes"]["transformer"] for w in info["rank_weights"]]
    # Qwen2.5-VL lives on the output rank only; the VAE on every rank.
    encoders = [w["bytes"]["text_encoder"] for w in info["rank_weights"]]
    assert encoders[0] > 0 and encoders[1] == 0
    if info["parallel"]["tp"] == 2:
        ratio = max(pieces) / whole
        print(f"tp2 per-rank transformer bytes: {ratio:.3f} of one rank's")
        assert ratio <= 0.55, (pieces, whole)
    else:
        assert pieces == [whole, whole]


def test_lora_and_weight_updates_match_one_rank(
    single: WorkerProcess, split: WorkerProcess, tiny_qwen_lora: Path, tiny_qwen_model: Path,
    tiny_qwen_model_b: Path,
) -> None:  # fmt: skip
    base = _png(split)
    try:
        for worker in (single, split):
            with worker.client() as c:
                c.control("set_lora", lora_nickname="q", lora_path=str(tiny_qwen_lora))
        lora = _png(split)
        assert not _close(lora, base) and _close(lora, _png(single))
        with split.client() as c:
            c.control("set_lora", lora_nickname="q", strength=0.0)
        assert _png(split) == base
        for worker in (single, split):
            with worker.client() as c:
                c.control("update_weights_from_disk", model_path=str(tiny_qwen_model_b))
        assert _close(_png(split), _png(single)) and not _close(_png(split), base)
    finally:
        for worker in (single, split):
            with worker.client() as c:
                c.control("update_weights_from_disk", model_path=str(tiny_qwen_model))
    assert _png(split) == base


def test_a_request_s_own_lora_matches_one_rank(
    single: WorkerProcess, split: WorkerProcess, tiny_qwen_lora: Path, tiny_qwen_model: Path
) -> None:
    """A request's adapter (``lora``), cut to each tp rank's pieces, draws one rank's
    image; the next request without it is the base image again."""
    try:
        base = _png(split)
        ink = {"name": "ink", "path": str(tiny_qwen_lora), "scale": 0.8}
        asked = _png(split, lora=ink)
        assert not _close(asked, base) and _close(asked, _png(single, lora=ink))
        assert _png(split) == base
        assert _png(split, lora={"name": "ink", "scale": 0.8}) == asked  # cached, by name
    finally:  # drop the cached adapter: later tests weigh the transformer's layers
        for worker in (single, split):
            with worker.client() as c:
                c.control("update_weights_from_disk", model_path=str(tiny_qwen_model))


# A longer owls prompt than the other families': Qwen masks each row's text differently.
def test_a_batch_of_prompts_matches_one_rank_s_batch(
    single: WorkerProcess, split: WorkerProcess
) -> None:
    from tests.batches import assert_batches_match

    assert_batches_match(single, split, REQUEST, _close, owls="two owls on a branch at night")


def _stream(client: ReplicaClient, rid: str, body: dict[str, object]) -> list[p.Message]:
    """Every reply to ``rid``, up to and including its final one."""
    client.send_raw(p.encode(p.GENERATE, rid, body))
    replies = [client.recv()]
    while replies[-1].kind == p.PARTIAL:
        replies.append(client.recv())
    assert all(r.id == rid for r in replies)
    return replies


def test_previews_decode_qwen_s_packed_latents(split: WorkerProcess) -> None:
    """Previews under the split, and the final image the same bytes without them."""
    body = {**REQUEST, "num_inference_steps": 4, "partial_images": 2}
    with split.client() as client:
        replies = _stream(client, "previews", body)
        assert [r.kind for r in replies] == [p.PARTIAL] * 2 + [p.RESULT]
        previews = [r.body_as(p.PartialImage) for r in replies[:-1]]
        assert [(m.width, m.height) for m in previews] == [(64, 64)] * 2
        assert _pixels(replies[0].blobs[0]).shape == (64, 64, 3)
        plain = {k: v for k, v in body.items() if k != "partial_images"}
        (alone,) = _stream(client, "plain", plain)
        assert alone.blobs == replies[-1].blobs


def _files() -> list[bytes]:
    image, mask = Image.new("RGB", (64, 64), (30, 140, 220)), Image.new("L", (64, 64), 0)
    mask.paste(255, (16, 16, 48, 48))
    out = []
    for img in (image, mask):
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        out.append(buf.getvalue())
    return out


def test_edits_of_two_images_match_one_rank(single: WorkerProcess, split: WorkerProcess) -> None:
    """Image-to-image and inpainting (diffusers' Qwen-Image siblings share the split
    transformer), two images a call."""
    for edit in ({"images": [0], "strength": 0.8}, {"images": [0], "mask": 1, "strength": 0.9}):
        body = {**REQUEST, "n": 2, "seed": [3, 4], "edit": edit}
        images = []
        for worker in (single, split):
            with worker.client() as client:
                client.send_raw(p.encode(p.GENERATE, "edit", body, _files()))
                reply = client.recv()
                assert reply.kind == p.RESULT, reply.body
                images.append(reply.blobs)
        assert len(images[0]) == 2 and all(map(_close, *images)), edit
