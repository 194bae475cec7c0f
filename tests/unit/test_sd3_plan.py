"""SD3's tp plan and static constraints, without a gang: tp2's pieces hold at most
0.55 of the transformer's bytes; the text tokens the supervisor checks count CLIP's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dpserve.contract.layout import ParallelConfig
from dpserve.worker.parallel.families import PLANS
from dpserve.worker.parallel.sd3 import sd3_plan
from dpserve.worker.parallel.tensor import TensorParallel
from dpserve.worker.splittable import FAMILIES, layout_problem, text_tokens_problem
from dpserve.worker.tiny_sd3 import CLIP_TOKENS, SD3_VARIANTS


def _transformer(variant: str) -> torch.nn.Module:
    from diffusers.models.transformers.transformer_sd3 import SD3Transformer2DModel

    v = SD3_VARIANTS[variant]
    inner = v.num_attention_heads * v.attention_head_dim
    return SD3Transformer2DModel(
        sample_size=8,
        in_channels=16,
        num_layers=v.num_layers,
        attention_head_dim=v.attention_head_dim,
        num_attention_heads=v.num_attention_heads,
        joint_attention_dim=v.text_dim,
        caption_projection_dim=inner,
        pooled_projection_dim=2 * v.clip_dim,
        out_channels=16,
        pos_embed_max_size=v.pos_embed_max_size,
        dual_attention_layers=v.dual_attention_layers,
        qk_norm="rms_norm",
    )


def _bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in module.state_dict().values())


@pytest.mark.parametrize("variant", ["sd3", "sd3-small"])
def test_tp2_pieces_hold_at_most_055_of_the_transformer(variant: str) -> None:
    transformer = _transformer(variant)
    whole = _bytes(transformer)
    plan = sd3_plan(transformer)
    # Every block's attentions (attn2 too), MLPs and modulations; the last block's
    # text stream has no output projection or MLP.
    last = len(transformer.transformer_blocks) - 1
    assert "transformer_blocks.0.attn2.to_q" in plan
    assert f"transformer_blocks.{last}.attn.to_add_out" not in plan
    assert f"transformer_blocks.{last}.ff_context.net.2" not in plan
    group: object = None
    TensorParallel(plan, group, 0, 2).shard(transformer)  # type: ignore[arg-type]
    ratio = _bytes(transformer) / whole
    print(f"{variant}: tp2 piece {ratio:.3f} of the transformer")
    assert ratio <= 0.55
    assert PLANS["SD3Transformer2DModel"].tensor_plan is sd3_plan


def test_sd3_text_tokens_count_clip_and_t5(tmp_path: Path) -> None:
    kind = "SD3Transformer2DModel"
    assert text_tokens_problem(kind, 32, 4, CLIP_TOKENS) is None
    problem = text_tokens_problem(kind, 256, 2, 77)
    assert problem is not None and "77 CLIP + 256 T5" in problem and "= 333" in problem
    assert text_tokens_problem(kind, 255, 2, 77) is None
    (tmp_path / "transformer").mkdir()
    (tmp_path / "tokenizer").mkdir()
    config = {"_class_name": kind, "num_attention_heads": 4}
    (tmp_path / "transformer" / "config.json").write_text(json.dumps(config))
    (tmp_path / "tokenizer" / "tokenizer_config.json").write_text('{"model_max_length": 77}')
    assert "(77 CLIP + 32 T5" in str(layout_problem(tmp_path, ParallelConfig(sp=2), 32))
    assert layout_problem(tmp_path, ParallelConfig(sp=2, tp=2), 31) is None
    heads = layout_problem(tmp_path, ParallelConfig(sp=8, ulysses=8), 35)
    assert heads is not None and "attention heads (4)" in heads


def test_batched_cfg_takes_each_ranks_half_of_every_batch_argument() -> None:
    from dpserve.worker.denoiser import DenoiserPatch, _batch_half

    latents, text = torch.arange(4.0).reshape(2, 2), [torch.zeros(2, 3), torch.ones(2, 3)]
    assert torch.equal(_batch_half(latents, 2, 1), latents[1:])
    halves = _batch_half(text, 2, 0)
    assert isinstance(halves, list) and [h.shape for h in halves] == [(1, 3), (1, 3)]
    assert _batch_half(torch.tensor(3.0), 2, 1).ndim == 0  # not a batch: as it is
    assert _batch_half([1, 2], 2, 1) == [1, 2]
    sd3 = _transformer("sd3")
    group: object = object()
    assert DenoiserPatch(0, group, lambda: None).can_split(sd3)  # type: ignore[arg-type]
    # The family's trait picks the batched split; Flux's pipelines call once a branch.
    assert FAMILIES["SD3Transformer2DModel"].batched_cfg and DenoiserPatch.batched(sd3)
    assert not FAMILIES["FluxTransformer2DModel"].batched_cfg
    assert not DenoiserPatch(0, None, lambda: None).can_split(sd3)
