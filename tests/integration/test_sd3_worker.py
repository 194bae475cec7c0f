"""SD3 through the worker's ZMQ front, split (tp2, ulysses2, cfg2) against one rank: a
request's own LoRA, the service's (``set_lora``) and weight updates, and a batch of
prompts, each within one grey level of one rank's (the images and memory of a
tp2 x cfg2 gang: test_sd3_parallel.py)."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.workers import WorkerProcess

pytestmark = pytest.mark.gang

FLAGS = ("--max-sequence-length", "32", "--max-batch", "4")
REQUEST = dict(
    prompt="a red fox in the snow",
    negative_prompt="blurry",
    guidance_scale=4.0,
    width=64,
    height=64,
    num_inference_steps=3,
    seed=[21],
)
# cfg2: each CFG rank runs a batch of one where one rank runs a batch of two (SD3
# batches its branches), so within a grey level, not bitwise (test_sd3_parallel.py).
LAYOUTS = {"tp2": ("--tp", "2"), "ulysses2": ("--sp", "2"), "cfg2": ("--cfg", "2")}


def _pixels(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png))).astype(np.int16)


def _close(a: bytes, b: bytes) -> bool:
    return int(np.abs(_pixels(a) - _pixels(b)).max()) <= 1


def _png(worker: WorkerProcess, **fields: object) -> bytes:
    with worker.client() as c:
        return c.generate(**{**REQUEST, **fields})[1][0]


@pytest.fixture(scope="module")
def single(tiny_sd3_model: Path, allow_tmp: tuple[str, str]) -> Iterator[WorkerProcess]:
    with WorkerProcess(tiny_sd3_model, *FLAGS, *allow_tmp) as w:
        yield w


@pytest.fixture(scope="module", params=list(LAYOUTS))
def split(
    request: pytest.FixtureRequest, tiny_sd3_model: Path, allow_tmp: tuple[str, str]
) -> Iterator[WorkerProcess]:
    with WorkerProcess(tiny_sd3_model, *LAYOUTS[request.param], *FLAGS, *allow_tmp) as w:
        yield w


def test_a_request_s_own_lora_matches_one_rank(
    single: WorkerProcess, split: WorkerProcess, tiny_sd3_lora: Path, tiny_sd3_model: Path
) -> None:
    try:
        base = _png(split)
        ink = {"name": "ink", "path": str(tiny_sd3_lora), "scale": 0.8}
        asked = _png(split, lora=ink)
        assert not _close(asked, base) and _close(asked, _png(single, lora=ink))
        assert _png(split) == base  # nothing stays on
        assert _png(split, lora={"name": "ink", "scale": 0.8}) == asked  # cached, by name
    finally:  # drop the cached adapter: later tests weigh the transformer's layers
        for worker in (single, split):
            with worker.client() as c:
                c.control("update_weights_from_disk", model_path=str(tiny_sd3_model))


def test_lora_and_weight_updates_match_one_rank(
    single: WorkerProcess, split: WorkerProcess, tiny_sd3_lora: Path, tiny_sd3_model: Path,
    tiny_sd3_model_b: Path,
) -> None:  # fmt: skip
    base = _png(split)
    try:
        for worker in (single, split):
            with worker.client() as c:
                c.control("set_lora", lora_nickname="s", lora_path=str(tiny_sd3_lora))
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
                c.control("update_weights_from_disk", model_path=str(tiny_sd3_model_b))
        assert _close(_png(split), _png(single)) and not _close(_png(split), base)
    finally:
        for worker in (single, split):
            with worker.client() as c:
                c.control("update_weights_from_disk", model_path=str(tiny_sd3_model))
    assert _png(split) == base


def test_a_batch_of_prompts_matches_one_rank_s_batch(
    single: WorkerProcess, split: WorkerProcess
) -> None:
    from tests.batches import assert_batches_match

    assert_batches_match(single, split, REQUEST, _close)
