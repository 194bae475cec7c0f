"""Sequence- and tensor-parallel replicas against a one-rank replica, through the ZMQ front.

The images of every layout match one rank's (float32: within one grey level);
tp ranks hold about half the transformer each; LoRA adapters, weight updates
and realtime frames agree with one rank's; sizes and layouts the model cannot
split are refused, naming what works.
"""

from __future__ import annotations

import io
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from dpserve.contract import realtime as rt
from dpserve.contract.protocol import (
    RequestError,
)
from tests.parallel_harness import REQUEST as GANG_REQUEST
from tests.workers import WorkerProcess

pytestmark = pytest.mark.gang

FLAGS = ("--max-sequence-length", "64", "--max-batch", "4")
REQUEST = {**GANG_REQUEST, "seed": 21}  # the gang-math request, through a real driver
LAYOUTS = {"tp2": ("--tp", "2"), "ulysses2": ("--sp", "2"), "ring2": ("--sp", "2", "--ring", "2")}


def _pixels(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png))).astype(np.int16)


def _close(a: bytes, b: bytes) -> bool:
    return int(np.abs(_pixels(a) - _pixels(b)).max()) <= 1


@pytest.fixture(scope="module")
def single(tiny_model: Path, allow_tmp: tuple[str, str]) -> Iterator[WorkerProcess]:
    with WorkerProcess(tiny_model, *FLAGS, *allow_tmp) as w:
        yield w


@pytest.fixture(scope="module", params=list(LAYOUTS))
def split(
    request: pytest.FixtureRequest, tiny_model: Path, allow_tmp: tuple[str, str]
) -> Iterator[WorkerProcess]:
    with WorkerProcess(tiny_model, *LAYOUTS[request.param], *FLAGS, *allow_tmp) as w:
        yield w


def _png(worker: WorkerProcess, **fields: object) -> bytes:
    with worker.client() as c:
        return c.generate(**{**REQUEST, **fields})[1][0]


def test_images_match_one_rank(single: WorkerProcess, split: WorkerProcess) -> None:
    for fields in ({}, {"negative_prompt": None, "true_cfg_scale": None}, {"width": 128}):
        assert _close(_png(split, **fields), _png(single, **fields)), fields


def test_each_rank_holds_its_share_of_the_transformer(
    single: WorkerProcess, split: WorkerProcess
) -> None:
    with single.client() as c:
        whole = c.control("model_info")["rank_weights"][0]["bytes"]["transformer"]
    with split.client() as c:
        info = c.control("model_info")
        result, _ = c.generate(**REQUEST)
    pieces = [w["bytes"]["transformer"] for w in info["rank_weights"]]
    assert len(pieces) == 2 and result.peak_memory_mb > 0
    # The text encoders live on the output rank only; the VAE on every rank.
    encoders = [
        (w["bytes"]["text_encoder"], w["bytes"]["text_encoder_2"]) for w in info["rank_weights"]
    ]
    assert min(encoders[0]) > 0 and encoders[1] == (0, 0)
    assert info["rank_weights"][0]["bytes"]["vae"] == info["rank_weights"][1]["bytes"]["vae"]
    if info["parallel"]["tp"] == 2:
        assert all(0.45 * whole < p < 0.6 * whole for p in pieces), (pieces, whole)
        assert [w["tp_rank"] for w in info["rank_weights"]] == [0, 1]
    else:  # sp ranks hold the whole transformer and split the tokens instead
        assert pieces == [whole, whole]
        assert [w["sp_rank"] for w in info["rank_weights"]] == [0, 1]


def test_lora_and_weight_updates_match_one_rank(
    single: WorkerProcess, split: WorkerProcess, tiny_lora: Path, tiny_model: Path,
    tiny_model_b: Path,
) -> None:  # fmt: skip
    base = _png(split)
    try:
        for worker in (single, split):
            with worker.client() as c:
                c.control("set_lora", lora_nickname="s", lora_path=str(tiny_lora))
        lora = _png(split)
        assert not _close(lora, base) and _close(lora, _png(single))
        with split.client() as c:
            c.control("merge_lora_weights")
            assert _close(_png(split), lora)
            c.control("unmerge_lora_weights")
            assert _png(split) == lora  # the saved base pieces come back exactly
            c.control("set_lora", lora_nickname="s", strength=0.0)
        assert _png(split) == base
        for worker in (single, split):
            with worker.client() as c:
                c.control("update_weights_from_disk", model_path=str(tiny_model_b))
        assert _close(_png(split), _png(single)) and not _close(_png(split), base)
    finally:
        for worker in (single, split):
            with worker.client() as c:
                c.control("update_weights_from_disk", model_path=str(tiny_model))
    assert _png(split) == base


def test_a_batch_of_prompts_matches_one_rank_s_batch(
    single: WorkerProcess, split: WorkerProcess
) -> None:
    from tests.batches import assert_batches_match

    assert_batches_match(single, split, REQUEST, _close)


def test_realtime_frames_match_one_rank(single: WorkerProcess, split: WorkerProcess) -> None:
    params = rt.SessionParams(
        prompt="a red fox", width=64, height=64, num_inference_steps=3, frame_steps=2, seed=4
    )
    buf = io.BytesIO()
    Image.new("RGB", (64, 64), (230, 40, 30)).save(buf, format="PNG")
    frames: dict[str, list[bytes]] = {}
    for name, worker in (("single", single), ("split", split)):
        got = []
        with worker.client() as c:
            # From the seed, and image-to-image from a starting image (the VAE encodes
            # it on every rank; the text encoders' outputs come from the output rank).
            for sid, image in (("p", None), ("q", buf.getvalue())):
                opened = rt.SessionRequest(
                    action="open", session_id=sid, params=params, first_frame=0 if image else None
                )
                got.append(c.session(opened, [image] if image else [])[1][0])
                for prompt in (None, "a red fox at night"):
                    request = rt.SessionRequest(action="step", session_id=sid, prompt=prompt)
                    got.append(c.session(request)[1][0])
                c.session(rt.SessionRequest(action="close", session_id=sid))
        frames[name] = got
    assert len(frames["split"]) == 6
    assert all(_close(a, b) for a, b in zip(frames["split"], frames["single"], strict=True))


def test_release_resume_and_checksums_keep_the_pieces(split: WorkerProcess) -> None:
    with split.client() as c:
        before = c.control("get_weights_checksum")
        png = _png(split)
        c.control("release_memory_occupation")
        weights = c.control("model_info")["rank_weights"]
        assert all(w["bytes"]["transformer"] == 0 for w in weights)
        c.control("resume_memory_occupation")
        assert c.control("get_weights_checksum") == before
    assert _png(split) == png


def test_sizes_the_sp_ranks_cannot_split_are_refused_naming_sizes_that_work(
    tiny_model: Path,
) -> None:
    with WorkerProcess(tiny_model, "--sp", "2", *FLAGS) as w, w.client() as c:
        with pytest.raises(RequestError) as err:
            c.generate(**{**REQUEST, "width": 80, "height": 48})  # 5 x 3 = 15 tokens
        assert err.value.code == "invalid_request"
        assert "15 image tokens" in str(err.value) and "e.g. 64x48" in str(err.value)
        _, (png,) = c.generate(**{**REQUEST, "width": 64, "height": 48})  # 12 tokens
        assert png.startswith(b"\x89PNG")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--tp", "2", "--sp", "2"), "attention heads (2) must be divisible by ulysses * tp (4)"),
        (("--sp", "2", "--max-sequence-length", "77"), "text tokens (77"),
    ],
)
def test_layouts_the_model_cannot_split_are_refused_before_any_rank_starts(
    tiny_model: Path, args: tuple[str, ...], message: str
) -> None:
    cmd = [sys.executable, "-m", "dpserve", "worker", "--model", str(tiny_model), "--port", "1"]
    done = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert message in done.stderr
    assert "started" not in done.stderr  # no rank was spawned
