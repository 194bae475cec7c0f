"""Pure pieces of sequence and tensor parallel: shard indices, LoRA cuts, LSE merging,
the Flux plan, size and layout refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dpserve.contract.layout import ParallelConfig, rank_info
from dpserve.contract.protocol import (
    RequestError,
)
from dpserve.contract.validation import (
    Limits,
    parse_generate,
)
from dpserve.worker.splittable import FAMILIES, layout_problem

torch = pytest.importorskip("torch")

from dpserve.worker.parallel import ModelParallel, ParallelGroups, ParallelUnsupported  # noqa: E402
from dpserve.worker.parallel.attention import _merge, attention_with_lse  # noqa: E402
from dpserve.worker.parallel.families import PLANS  # noqa: E402
from dpserve.worker.parallel.flux import flux_plan  # noqa: E402
from dpserve.worker.parallel.tensor import Shard, TensorParallel, shard_indices  # noqa: E402


def test_shard_indices_cut_each_packed_block() -> None:
    assert shard_indices(8, None, 1, 2) == slice(4, 8)
    # cat([attention (4), mlp (8)]): rank 1 takes the second half of each block.
    assert shard_indices(12, (4, 8), 1, 2) == [2, 3, 8, 9, 10, 11]
    with pytest.raises(ValueError, match="cannot be split 4 ways"):
        shard_indices(12, (6, 6), 0, 4)


def test_every_family_s_traits_are_what_its_plan_does() -> None:
    """The supervisor's torch-free table promises what the ranks' plans do."""
    assert set(PLANS) == set(FAMILIES)
    for name, plan in PLANS.items():
        traits = FAMILIES[name]
        assert traits.tp == (plan.tensor_plan is not None), name
        assert traits.sp == (plan.cut is not None and plan.processor is not None), name


def test_lora_matrices_are_cut_like_the_weights_they_adapt() -> None:
    plan = {"a.q": Shard("column"), "a.out": Shard("row"), "p": Shard("row", (2, 4))}
    tp = TensorParallel(plan, group=None, rank=1, degree=2)  # type: ignore[arg-type]
    a, b = torch.arange(24.0).reshape(4, 6), torch.arange(24.0).reshape(6, 4)
    state = {
        "transformer.a.q.lora_A.weight": a,
        "transformer.a.q.lora_B.weight": b,
        "transformer.a.out.lora_A.weight": a,
        "transformer.a.out.lora_B.weight": b,
        "transformer.p.lora_A.weight": a,
        "transformer.other.lora_A.weight": a,
        "text_encoder.a.q.lora_A.weight": a,
    }
    cut = tp.shard_lora(state, "transformer.")
    assert torch.equal(cut["transformer.a.q.lora_A.weight"], a)  # column: A whole
    assert torch.equal(cut["transformer.a.q.lora_B.weight"], b[3:])  # ... B's rows split
    assert torch.equal(cut["transformer.a.out.lora_A.weight"], a[:, 3:])  # row: A's columns
    assert torch.equal(cut["transformer.a.out.lora_B.weight"], b)
    assert torch.equal(cut["transformer.p.lora_A.weight"], a[:, [1, 4, 5]])  # packed blocks
    assert cut["transformer.other.lora_A.weight"] is a
    assert cut["text_encoder.a.q.lora_A.weight"] is a


def test_partial_attentions_merge_exactly_by_log_sum_exp() -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 8, generator=gen) for _ in range(3))
    scale = 8**-0.5
    whole = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale)
    first = attention_with_lse(q, k[:, :, :2], v[:, :, :2], scale)
    second = attention_with_lse(q, k[:, :, 2:], v[:, :, 2:], scale)
    merged, lse = _merge(first[0].float(), first[1], *second)
    assert torch.allclose(merged, whole, atol=1e-6)
    scores = (q @ k.transpose(-1, -2)) * scale
    assert torch.allclose(lse, torch.logsumexp(scores, -1), atol=1e-6)


def test_the_flux_plan_splits_about_all_block_weights(tiny4_model: Path) -> None:
    from diffusers.models.transformers.transformer_flux import FluxTransformer2DModel

    transformer = FluxTransformer2DModel.from_pretrained(tiny4_model, subfolder="transformer")
    plan = flux_plan(transformer)
    planned = sum(transformer.get_submodule(p).weight.numel() for p in plan)
    blocks = sum(
        p.numel()
        for name, p in transformer.named_parameters()
        if "transformer_blocks" in name and name.endswith("weight") and p.ndim == 2
    )
    assert planned == blocks  # every matrix of every block is split
    TensorParallel(plan, group=None, rank=0, degree=4).check(transformer)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cannot split"):
        TensorParallel(plan, group=None, rank=0, degree=3).check(transformer)  # type: ignore[arg-type]


def test_sizes_whose_tokens_sp_cannot_split_are_refused_naming_sizes_that_work() -> None:
    limits = Limits(size_factor=16, sequence_split=4)
    with pytest.raises(RequestError) as err:
        parse_generate({"prompt": "a", "size": "80x80"}, limits)  # 25 tokens
    assert err.value.fields[0].field == "size"
    message = err.value.fields[0].message
    assert "25 image tokens" in message and "multiple of 4" in message
    assert "e.g. 64x80, 80x64" in message
    assert parse_generate({"prompt": "a", "width": 64, "height": 80}, limits).width == 64
    assert parse_generate({"prompt": "a", "width": 80}, limits).width == 80  # height: default


def _model(tmp_path: Path, kind: str, heads: int) -> Path:
    (tmp_path / "transformer").mkdir(parents=True)
    config = {"_class_name": kind, "num_attention_heads": heads}
    (tmp_path / "transformer" / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_layouts_a_model_cannot_split_are_named_before_start(tmp_path: Path) -> None:
    flux = _model(tmp_path, "FluxTransformer2DModel", 24)
    assert layout_problem(flux, ParallelConfig(tp=2, sp=4, ulysses=2, ring=2), None) is None
    assert "divisible by ulysses * tp (16)" in str(
        layout_problem(flux, ParallelConfig(tp=4, sp=4), None)
    )
    assert "text tokens (77" in str(layout_problem(flux, ParallelConfig(sp=2), 77))
    assert layout_problem(flux, ParallelConfig(cfg=2), 77) is None  # CFG splits nothing
    other = _model(tmp_path / "q", "HunyuanVideoTransformer3DModel", 24)
    assert (
        "tp needs a transformer it can split (FluxTransformer2DModel, WanTransformer3DModel, "
        "Flux2Transformer2DModel, SD3Transformer2DModel, QwenImageTransformer2DModel); "
        "this model's denoiser is HunyuanVideoTransformer3DModel"
    ) in str(layout_problem(other, ParallelConfig(tp=2), None))
    # A video transformer: sp cuts its frames x tokens (and not its text), tp its heads.
    wan = _model(tmp_path / "w", "WanTransformer3DModel", 2)
    assert layout_problem(wan, ParallelConfig(sp=2, ring=2), 77) is None
    assert layout_problem(wan, ParallelConfig(tp=2), None) is None
    assert "divisible by ulysses * tp (4)" in str(
        layout_problem(wan, ParallelConfig(tp=2, sp=2, ulysses=2), None)
    )
    unet = tmp_path / "unet"
    unet.mkdir()
    assert "no transformer/config.json" in str(layout_problem(unet, ParallelConfig(sp=2), None))


def test_encoder_outputs_cross_the_gang_exactly() -> None:
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    from dpserve.worker.parallel.encoders import _TENSORS, _pack, _unpack

    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(1, 5, 4, generator=gen, dtype=torch.bfloat16)
    layers = (torch.randn(1, 5, 4, generator=gen), torch.randn(1, 5, 4, generator=gen))
    output = BaseModelOutputWithPooling(
        last_hidden_state=hidden, pooler_output=hidden[:, 0], hidden_states=layers
    )
    back = _unpack(_TENSORS + _pack(output), torch.device("cpu"))
    assert type(back) is BaseModelOutputWithPooling
    assert (
        torch.equal(back.last_hidden_state, hidden) and back.last_hidden_state.dtype == hidden.dtype
    )
    assert torch.equal(back.pooler_output, hidden[:, 0])
    assert all(torch.equal(a, b) for a, b in zip(back.hidden_states, layers, strict=True))
    assert torch.equal(back[0], hidden)  # T5's way of reading it
    pair = _unpack(_TENSORS + _pack((hidden, layers[0])), torch.device("cpu"))
    assert isinstance(pair, tuple) and torch.equal(pair[1], layers[0])
    with pytest.raises(RuntimeError, match="output rank's text encoder failed: boom"):
        _unpack(b"Eboom", torch.device("cpu"))


def test_an_encoder_relay_carries_only_what_the_pipeline_reads() -> None:
    """Qwen-Image reads the last of Qwen2.5-VL's hidden states: the logits and the
    other layers travel as empty tensors, the tuple keeps its length, and what is read
    arrives exactly. The bytes shrink by the unread share (26 of 27 tensors here)."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    from dpserve.worker.parallel.encoder_reads import Reads
    from dpserve.worker.parallel.encoders import _TENSORS, _pack, _unpack

    gen = torch.Generator().manual_seed(2)
    layers = tuple(torch.randn(1, 64, 64, generator=gen).bfloat16() for _ in range(26))
    logits = torch.randn(1, 64, 64, generator=gen).bfloat16()
    output = CausalLMOutputWithPast(logits=logits, hidden_states=layers)
    last = Reads(frozenset({"hidden_states"}), frozenset({-1}))
    whole, lean = _pack(output), _pack(output, last)
    ratio = len(lean) / len(whole)
    print(f"relayed bytes, last layer only: {ratio:.3f} of the whole output's")
    assert ratio < 2 / 27, (len(lean), len(whole))  # one tensor of 27, and the header
    back = _unpack(_TENSORS + lean, torch.device("cpu"))
    assert type(back) is CausalLMOutputWithPast and len(back.hidden_states) == 26
    assert torch.equal(back.hidden_states[-1], layers[-1])
    assert back.hidden_states[-1].dtype == torch.bfloat16
    assert all(h.numel() == 0 and h.dtype == torch.bfloat16 for h in back.hidden_states[:-1])
    assert back.logits.numel() == 0
    # FLUX.2 [klein]'s three layers, SD3's pooled CLIP output and its layer -2.
    chosen = Reads(frozenset({"hidden_states"}), frozenset({9, 18, 25}))
    back = _unpack(_TENSORS + _pack(output, chosen), torch.device("cpu"))
    kept = [i for i, h in enumerate(back.hidden_states) if h.numel()]
    assert kept == [9, 18, 25] and all(torch.equal(back.hidden_states[i], layers[i]) for i in kept)


def test_each_pipeline_s_reads_follow_its_encode_prompt() -> None:
    from diffusers import (
        FluxPipeline,
        QwenImageEditPipeline,
        QwenImagePipeline,
        StableDiffusion3Img2ImgPipeline,
        StableDiffusion3Pipeline,
    )
    from diffusers.pipelines.flux2.pipeline_flux2 import Flux2Pipeline
    from diffusers.pipelines.flux2.pipeline_flux2_klein import Flux2KleinPipeline

    from dpserve.worker.parallel.encoder_reads import Reads, reads_of

    def reads(cls: type) -> dict[str, Reads]:
        return reads_of(cls.__new__(cls))  # the class's own code, no weights

    hidden = frozenset({"hidden_states"})
    for qwen in (QwenImagePipeline, QwenImageEditPipeline):
        assert reads(qwen) == {"text_encoder": Reads(hidden, frozenset({-1}))}
    assert reads(Flux2KleinPipeline) == {"text_encoder": Reads(hidden, frozenset({9, 18, 27}))}
    assert reads(Flux2Pipeline) == {"text_encoder": Reads(hidden, frozenset({10, 20, 30}))}
    clip = Reads(frozenset({"text_embeds", "hidden_states"}), frozenset({-2}))
    for sd3 in (StableDiffusion3Pipeline, StableDiffusion3Img2ImgPipeline):
        assert reads(sd3) == {"text_encoder": clip, "text_encoder_2": clip}
    assert reads(FluxPipeline) == {}  # T5 without hidden states: relayed whole


@pytest.mark.parametrize(
    ("layout", "pipe", "reason"),
    [
        # Wan 2.2 TI2V's per-token timesteps: the cut does not carry them.
        (ParallelConfig(sp=2), {"config": {"expand_timesteps": True}}, "per-token timesteps"),
    ],
)
def test_pipelines_a_gang_cannot_split_are_refused_once_loaded(
    layout: ParallelConfig, pipe: dict[str, object], reason: str
) -> None:
    from types import SimpleNamespace

    parallel = ModelParallel(rank_info(layout, 0), ParallelGroups(), layout)
    loaded = SimpleNamespace(**{"config": {}, "transformer": object(), **pipe})
    with pytest.raises(ParallelUnsupported, match=reason):
        parallel.check_loaded(loaded, None)
    one = ParallelConfig()
    ModelParallel(rank_info(one, 0), ParallelGroups(), one).check_loaded(loaded, None)


def test_a_second_denoiser_is_split_as_the_first() -> None:
    """Wan 2.2's two experts: the stack patches both (test_wan_tp_parallel.py), so a
    gang accepts them."""
    from types import SimpleNamespace

    layout = ParallelConfig(cfg=2)
    parallel = ModelParallel(rank_info(layout, 0), ParallelGroups(), layout)
    parallel.check_loaded(SimpleNamespace(config={}, transformer_2=object()), None)
