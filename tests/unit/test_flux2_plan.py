"""FLUX.2's plan in one process: what tp splits, that its packed pieces add up to the
whole block (SwiGLU halves and the single blocks' fused layers cut consistently), and
what a FLUX.2 gang refuses, naming why."""

from __future__ import annotations

import copy
import inspect
from pathlib import Path

import pytest

from dpserve.contract.layout import ParallelConfig
from dpserve.contract.protocol import RequestError
from dpserve.worker.splittable import layout_problem

torch = pytest.importorskip("torch")

from diffusers.models.transformers.transformer_flux2 import (  # noqa: E402
    Flux2ParallelSelfAttnProcessor,
    Flux2Transformer2DModel,
)

from dpserve.worker.parallel.attention import SequenceGroups  # noqa: E402
from dpserve.worker.parallel.flux2 import (  # noqa: E402
    MODULATIONS,
    Flux2Cut,
    _single_split,
    flux2_plan,
)
from dpserve.worker.parallel.tensor import TensorParallel  # noqa: E402


@pytest.fixture(scope="module")
def transformer(flux2_model: Path) -> Flux2Transformer2DModel:
    return Flux2Transformer2DModel.from_pretrained(flux2_model, subfolder="transformer").eval()


def _pieces(transformer: torch.nn.Module, degree: int) -> list[torch.nn.Module]:
    plan = flux2_plan(transformer)
    pieces = []
    for rank in range(degree):
        piece = copy.deepcopy(transformer)
        TensorParallel(plan, group=None, rank=rank, degree=degree).shard(piece)  # type: ignore[arg-type]
        pieces.append(piece)
    return pieces


def test_the_plan_splits_every_block_matrix_and_the_shared_modulations(
    transformer: Flux2Transformer2DModel,
) -> None:
    plan = flux2_plan(transformer)
    planned = sum(transformer.get_submodule(p).weight.numel() for p in plan)
    split = sum(
        p.numel()
        for name, p in transformer.named_parameters()
        if ("transformer_blocks" in name and p.ndim == 2) or name.startswith(MODULATIONS)
    )
    assert planned == split
    whole = sum(p.numel() for p in transformer.parameters())
    assert (whole - planned + planned / 2) / whole <= 0.55  # a tp2 rank's share
    TensorParallel(plan, group=None, rank=0, degree=4).check(transformer)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cannot split"):
        TensorParallel(plan, group=None, rank=0, degree=3).check(transformer)  # type: ignore[arg-type]


@torch.no_grad()
def test_tp_pieces_of_the_fused_and_swiglu_layers_add_up_to_the_whole(
    transformer: Flux2Transformer2DModel,
) -> None:
    """Row layers' partial outputs sum (the all-reduce): the pieces of a single
    block's fused attention+MLP and of a SwiGLU feed-forward give the whole's output."""
    pieces = _pieces(transformer, 2)
    x = torch.randn(1, 6, transformer.inner_dim, generator=torch.Generator().manual_seed(0))
    attn = transformer.single_transformer_blocks[0].attn
    want = Flux2ParallelSelfAttnProcessor()(attn, x, None, None)
    split = (p.single_transformer_blocks[0].attn for p in pieces)
    got = sum(_single_split(piece, SequenceGroups(), x, None) for piece in split)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for ff in ("ff", "ff_context"):
        want = getattr(transformer.transformer_blocks[0], ff)(x)
        got = sum(getattr(p.transformer_blocks[0], ff)(x) for p in pieces)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_reference_kv_caching_is_refused_under_sp(transformer: Flux2Transformer2DModel) -> None:
    call = inspect.signature(transformer.forward).bind(
        hidden_states=torch.zeros(1, 4, 16),
        encoder_hidden_states=torch.zeros(1, 4, 48),
        img_ids=torch.zeros(1, 4, 4),
        txt_ids=torch.zeros(1, 4, 4),
        kv_cache_mode="extract",
    )
    with pytest.raises(RequestError, match="kv_cache_mode"):
        Flux2Cut().lengths(transformer, call)
    call.arguments.pop("kv_cache_mode")
    assert Flux2Cut().lengths(transformer, call) == [
        ("image", 4),
        ("text", 4),
        ("image", 4),
        ("text", 4),
    ]


@pytest.mark.parametrize(
    ("layout", "text_tokens", "message"),
    [
        (dict(tp=8), None, "attention heads (4) must be divisible by ulysses * tp (8)"),
        (dict(tp=2, sp=4, ulysses=4), None, "divisible by ulysses * tp (8)"),
        (dict(sp=2, ulysses=2), 33, "text tokens (33"),
    ],
)
def test_layouts_a_flux2_model_cannot_take_are_named_before_start(
    flux2_model: Path, layout: dict[str, int], text_tokens: int | None, message: str
) -> None:
    problem = layout_problem(flux2_model, ParallelConfig(**layout), text_tokens)
    assert problem is not None and message in problem
    assert layout_problem(flux2_model, ParallelConfig(tp=2, sp=2, ulysses=2), 32) is None
