"""FLUX.2 (``Flux2Transformer2DModel``) split every way computes the single-rank result.

The tiny FLUX.2 is a ``Flux2KleinPipeline`` (4 heads): its CFG is guidance CFG
(``guidance_scale`` > 1 encodes an empty negative prompt), so a request with the
default scale has two branches for CFG gangs, and one at scale 1 has none (the CFG
ranks join the sequence split). Real gloo gangs, float32, same seed, one thread per
rank; the tolerance is the issue's, 1e-5 of the latents' magnitude.
"""

from __future__ import annotations

import functools
import io
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from dpserve.contract import protocol as p
from tests.parallel_harness import final_latents, gang_run, relative_error
from tests.workers import WorkerProcess

pytestmark = pytest.mark.gang

REQUEST = dict(
    prompt="a red fox in the snow",
    guidance_scale=4.0,
    width=64,
    height=64,
    num_inference_steps=3,
    seed=[7],
)
PLAIN = {**REQUEST, "guidance_scale": 1.0}  # no CFG: a CFG gang lends its ranks to sp

LAYOUTS = {
    "cfg2": dict(cfg=2),
    "ulysses2": dict(sp=2, ulysses=2),
    "ring2": dict(sp=2, ring=2),
    "tp2": dict(tp=2),
    "tp2xulysses2": dict(tp=2, sp=2, ulysses=2),
    "ulysses2xring2": dict(sp=4, ulysses=2, ring=2),
    "cfg2xtp2": dict(cfg=2, tp=2),
}


@pytest.fixture(scope="module")
def reference(flux2_model: Path) -> torch.Tensor:
    return final_latents(flux2_model, {}, REQUEST)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_one_rank(name: str, flux2_model: Path, reference: torch.Tensor) -> None:
    latents = final_latents(flux2_model, LAYOUTS[name], REQUEST)
    assert latents.shape == reference.shape
    error = relative_error(latents, reference)
    print(f"flux2 {name}: relative error {error:.2e}")
    if name == "cfg2":
        assert torch.equal(latents, reference)  # each rank runs one branch's exact forward
    else:
        assert error <= 1e-5, f"{name}: relative error {error:.2e}"


@pytest.fixture(scope="module")
def one_rank(flux2_model: Path) -> Callable[[], torch.Tensor]:
    return functools.cache(lambda: final_latents(flux2_model, {}, PLAIN))


@pytest.mark.parametrize("layout", [dict(cfg=2), dict(cfg=2, tp=2)], ids=["cfg2", "cfg2xtp2"])
def test_without_cfg_the_cfg_ranks_split_the_sequence(
    layout: dict[str, int], flux2_model: Path, one_rank: Callable[[], torch.Tensor]
) -> None:
    latents = final_latents(flux2_model, layout, PLAIN)
    error = relative_error(latents, one_rank())
    print(f"flux2 lent {layout}: relative error {error:.2e}")
    assert 0 < error <= 1e-5, f"relative error {error:.2e}"


def test_tp_ranks_read_only_their_pieces(flux2_model: Path, reference: torch.Tensor) -> None:
    """Loaded whole and cut after gives the latents reading pieces gives, bitwise; each
    tp rank reads about half the checkpoint."""
    read, reads = gang_run(flux2_model, dict(tp=2), REQUEST, read=True)
    cut = final_latents(flux2_model, dict(tp=2), REQUEST, read=False)
    assert torch.equal(read, cut)
    shares = [r["share"] for r in reads]
    print(f"flux2 tp2 read shares {shares}")
    assert all(s is not None and s <= 0.55 for s in shares), shares


# ------------------------------------------------------------ through the ZMQ front

TOKENS = ("--max-sequence-length", "32")
BATCH = ("--max-batch", "4")


def _pixels(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png))).astype(np.int16)


def _gap(a: bytes, b: bytes) -> int:
    return int(np.abs(_pixels(a) - _pixels(b)).max())


def _png(worker: WorkerProcess, **fields: object) -> bytes:
    with worker.client() as c:
        return c.generate(**{**REQUEST, "seed": 21, **fields})[1][0]


def _edited(worker: WorkerProcess) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (64, 64), (230, 30, 30)).save(buf, format="PNG")
    body = {**REQUEST, "seed": 21, "edit": {"images": [0]}}
    with worker.client() as c:
        reply = c.call(p.GENERATE, body, blobs=[buf.getvalue()])
    return reply.blobs[reply.body_as(p.GenerateResult).images[0].blob]


@pytest.fixture(scope="module")
def single(flux2_model: Path, allow_tmp: tuple[str, str]) -> Iterator[WorkerProcess]:
    with WorkerProcess(flux2_model, *TOKENS, *BATCH, *allow_tmp) as w:
        yield w


# tp, and a CFG gang with a ring (ulysses is the math tests'): a few seconds each.
SPLITS = {"tp2": ("--tp", "2"), "cfg2xring2": ("--cfg", "2", "--sp", "2", "--ring", "2")}


@pytest.fixture(scope="module", params=list(SPLITS))
def split(
    request: pytest.FixtureRequest, flux2_model: Path, allow_tmp: tuple[str, str]
) -> Iterator[WorkerProcess]:
    with WorkerProcess(flux2_model, *SPLITS[request.param], *TOKENS, *BATCH, *allow_tmp) as w:
        yield w


def test_split_replicas_serve_one_rank_s_images(
    single: WorkerProcess, split: WorkerProcess
) -> None:
    """With CFG, without (a CFG gang lends its ranks to the sequence split), at
    another size, and an edit; tp ranks hold at most 0.55 of the transformer each."""
    for fields in ({}, {"guidance_scale": 1.0}, {"width": 128}):
        assert _gap(_png(split, **fields), _png(single, **fields)) <= 1, fields
    # An edit: klein conditions on the image's latents, more image tokens to cut.
    assert _gap(_edited(split), _edited(single)) <= 1
    with single.client() as c:
        whole = c.control("model_info")["rank_weights"][0]["bytes"]["transformer"]
    with split.client() as c:
        info = c.control("model_info")
    weights = info["rank_weights"]
    pieces = [w["bytes"]["transformer"] for w in weights]
    if info["parallel"]["tp"] == 2:
        share = max(pieces) / whole
        print(f"flux2 tp2 transformer bytes per rank {pieces} of {whole}: {share:.3f}")
        assert share <= 0.55, (pieces, whole)
    else:
        assert pieces == [whole] * len(weights)
    # The Qwen3 text encoder lives on the output rank only; the VAE on every rank.
    holders = [w["bytes"]["text_encoder"] > 0 for w in weights]
    assert holders == [True] + [False] * (len(weights) - 1)
    assert len({w["bytes"]["vae"] for w in weights}) == 1


def test_a_cfg2_gang_draws_one_rank_s_bytes(
    single: WorkerProcess, flux2_model: Path, allow_tmp: tuple[str, str]
) -> None:
    """The output rank's Qwen3 relays only the three hidden states the pipeline stacks
    (parallel/encoder_reads.py); each CFG rank runs one branch exactly on them."""
    with WorkerProcess(flux2_model, "--cfg", "2", *TOKENS, *allow_tmp) as cfg2:
        assert _png(cfg2) == _png(single)


def _stream(worker: WorkerProcess, rid: str, body: dict[str, object]) -> list[p.Message]:
    """Every reply to ``rid``, up to and including its final one."""
    with worker.client() as client:
        client.send_raw(p.encode(p.GENERATE, rid, body))
        replies = [client.recv()]
        while replies[-1].kind == p.PARTIAL:
            replies.append(client.recv())
    assert all(r.id == rid for r in replies)
    return replies


def test_previews_decode_flux2_s_patchified_latents(
    single: WorkerProcess, split: WorkerProcess
) -> None:
    """FLUX.2's previews (tokens of 2x2 patches, batch-normed by the VAE) under the
    split are one rank's within a grey level, and the final image is the same bytes
    as without previews."""
    body = {**REQUEST, "seed": 21, "width": 64, "height": 48, "num_inference_steps": 4,
            "partial_images": 2}  # fmt: skip
    workers = {"one": single, "split": split}
    replies = {name: _stream(w, "previews", body) for name, w in workers.items()}
    for got in replies.values():
        assert [r.kind for r in got] == [p.PARTIAL] * 2 + [p.RESULT]
        previews = [r.body_as(p.PartialImage) for r in got[:-1]]
        assert [(m.width, m.height, m.index) for m in previews] == [(64, 48, 0), (64, 48, 1)]
    for got, want in zip(replies["split"], replies["one"], strict=True):
        assert _gap(got.blobs[0], want.blobs[0]) <= 1
    plain = {k: v for k, v in body.items() if k != "partial_images"}
    (alone,) = _stream(split, "plain", plain)
    assert alone.blobs == replies["split"][-1].blobs
    assert _gap(replies["one"][0].blobs[0], replies["one"][-1].blobs[0]) > 1  # mid-run


def test_fused_lora_and_weight_updates_match_one_rank(
    single: WorkerProcess, split: WorkerProcess, flux2_lora: Path, flux2_model: Path,
    flux2_model_b: Path,
) -> None:  # fmt: skip
    """A LoRA on the single blocks' fused layers and the SwiGLU inputs is cut in the
    same packed blocks as the weights it adapts (tp), and loads beside a stand-in text
    encoder (every gang)."""
    base = _png(split)
    try:
        for worker in (single, split):
            with worker.client() as c:
                c.control("set_lora", lora_nickname="f", lora_path=str(flux2_lora))
        lora = _png(split)
        assert _gap(lora, base) > 1 and _gap(lora, _png(single)) <= 1
        with split.client() as c:
            c.control("merge_lora_weights")
            assert _gap(_png(split), lora) <= 1
            c.control("unmerge_lora_weights")
            assert _png(split) == lora  # the saved base pieces come back exactly
            c.control("set_lora", lora_nickname="f", strength=0.0)
        assert _png(split) == base
        for worker in (single, split):
            with worker.client() as c:
                c.control("update_weights_from_disk", model_path=str(flux2_model_b))
        assert _gap(_png(split), _png(single)) <= 1 and _gap(_png(split), base) > 1
    finally:
        for worker in (single, split):
            with worker.client() as c:
                c.control("update_weights_from_disk", model_path=str(flux2_model))
    assert _png(split) == base


def test_a_request_s_own_lora_matches_one_rank(
    single: WorkerProcess, split: WorkerProcess, flux2_lora: Path, flux2_model: Path
) -> None:
    """A request's adapter on the fused single-block layers, cut like the weights (tp)
    and beside a stand-in text encoder: one rank's image, and nothing left on after."""
    try:
        base = _png(split)
        ink = {"name": "ink", "path": str(flux2_lora), "scale": 0.8}
        asked = _png(split, lora=ink)
        assert _gap(asked, base) > 1 and _gap(asked, _png(single, lora=ink)) <= 1
        assert _png(split) == base
        assert _png(split, lora={"name": "ink", "scale": 0.8}) == asked  # cached, by name
    finally:  # drop the cached adapter: later tests weigh the transformer's layers
        for worker in (single, split):
            with worker.client() as c:
                c.control("update_weights_from_disk", model_path=str(flux2_model))


def test_a_batch_of_prompts_matches_one_rank_s_batch(
    single: WorkerProcess, split: WorkerProcess
) -> None:
    from tests.batches import assert_batches_match

    assert_batches_match(single, split, REQUEST, lambda a, b: _gap(a, b) <= 1)
