"""How a FLUX.2 transformer (``Flux2Transformer2DModel``, [dev] and [klein]) is split.

FLUX.2 takes its tokens as input as FLUX.1 does (image and text tokens, 4-axis
position ids: T, H, W, L), runs double-stream blocks (joint attention, separate
weights per stream) and then single-stream "parallel" blocks, whose one linear
makes q, k, v and the SwiGLU MLP's gate and up halves together and whose output
projection takes ``cat([attention, mlp])``.

- Sequence parallel (``Flux2Cut``): FLUX.1's cut (``FluxCut``), the text tokens
  split too (the pipelines pad every prompt to ``max_sequence_length``). The
  single blocks concatenate each rank's text and image slices and strip the text
  by its local length, so the cut holds through them. Reference-image KV caching
  (``Flux2KleinKVPipeline``'s ``kv_cache_mode``) is refused under the split.
- Attention (``SequenceParallelFlux2Processor``): the double blocks' is FLUX.1's
  split; the single blocks split their fused projection by its global ratio, so
  the same code runs on tp pieces.
- Tensor parallel (``flux2_plan``): heads split (q/k/v column, output row), both
  SwiGLU feed-forwards with their gate and up halves cut each on its own (packed
  blocks), the single blocks' fused layer cut as five blocks (q, k, v, gate, up) and
  its output projection as two (attention, mlp). **Decision:** the modulations are
  shared by all blocks of a stream (three layers, not one per block) but still the
  largest whole layers, so they are split by output and gathered like FLUX.1's
  per-block ones: on the tiny model they are a fifth of the weights. Embedders, the
  final norm and projection stay whole.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_flux2 import (
    Flux2AttnProcessor,
    Flux2KVAttnProcessor,
    Flux2KVParallelSelfAttnProcessor,
    Flux2ParallelSelfAttention,
    Flux2ParallelSelfAttnProcessor,
    Flux2Transformer2DModelOutput,
)

from dpserve.contract.protocol import INVALID_REQUEST, RequestError
from dpserve.worker.parallel.attention import SequenceGroups, parallel_attention
from dpserve.worker.parallel.flux import FluxCut, SequenceParallelFluxProcessor
from dpserve.worker.parallel.sequence import AttentionScope, Piece, SplitAttention
from dpserve.worker.parallel.tensor import Shard

COLUMN, ROW, GATHERED = Shard("column"), Shard("row"), Shard("gathered")
Forward = Callable[..., Any]
_KV_REFUSAL = (
    "FLUX.2 reference-image KV caching (kv_cache_mode) is not sequence-split: "
    "serve it with --tp or --cfg instead of --sp"
)
MODULATIONS = (
    "double_stream_modulation_img",
    "double_stream_modulation_txt",
    "single_stream_modulation",
)


def flux2_plan(transformer: Any) -> dict[str, Shard]:
    plan: dict[str, Shard] = {name + ".linear": GATHERED for name in MODULATIONS}
    for i, block in enumerate(transformer.transformer_blocks):
        p = f"transformer_blocks.{i}"
        for name in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"):
            plan[f"{p}.attn.{name}"] = COLUMN
        plan[f"{p}.attn.to_out.0"] = ROW
        plan[f"{p}.attn.to_add_out"] = ROW
        for ff in ("ff", "ff_context"):
            # SwiGLU: the first half of linear_in's output gates the second.
            half = getattr(block, ff).linear_in.out_features // 2
            plan[f"{p}.{ff}.linear_in"] = Shard("column", (half, half))
            plan[f"{p}.{ff}.linear_out"] = ROW
    for i, block in enumerate(transformer.single_transformer_blocks):
        p = f"single_transformer_blocks.{i}.attn"
        attn = block.attn
        inner, mlp = attn.inner_dim, attn.mlp_hidden_dim
        fused = (inner,) * 3 + (mlp,) * attn.mlp_mult_factor  # q, k, v, gate, up
        plan[f"{p}.to_qkv_mlp_proj"] = Shard("column", fused)
        plan[f"{p}.to_out"] = Shard("row", (inner, mlp))  # cat([attention, mlp])
    return plan


def _single_split(
    attn: Any, groups: SequenceGroups, hidden_states: torch.Tensor, rotary: Any
) -> torch.Tensor:
    """A single-stream block's attention and MLP on this rank's tokens (and, under
    tp, its piece of the heads and of the MLP)."""
    projected = attn.to_qkv_mlp_proj(hidden_states)
    # q, k, v and the MLP's input by their global ratio: a tp piece keeps it.
    qkv_dim = 3 * attn.inner_dim
    mlp_dim = attn.mlp_hidden_dim * attn.mlp_mult_factor
    local_qkv = projected.shape[-1] * qkv_dim // (qkv_dim + mlp_dim)
    qkv, mlp = projected.split([local_qkv, projected.shape[-1] - local_qkv], dim=-1)
    query, key, value = (x.unflatten(-1, (-1, attn.head_dim)) for x in qkv.chunk(3, dim=-1))
    query, key = attn.norm_q(query), attn.norm_k(key)
    if rotary is not None:
        query = apply_rotary_emb(query, rotary, sequence_dim=1)
        key = apply_rotary_emb(key, rotary, sequence_dim=1)
    out = parallel_attention(query, key, value, groups).flatten(2, 3).to(query.dtype)
    return attn.to_out(torch.cat([out, attn.mlp_act_fn(mlp)], dim=-1))


class SequenceParallelFlux2Processor(SplitAttention):
    """FLUX.2's attention, both kinds, spread over the sp ranks.

    diffusers calls the double blocks' processor as (attn, hidden, encoder hidden,
    mask, rotary) and the single blocks' as (attn, hidden, mask, rotary); the KV
    caching arguments arrive by name (the attention module passes on only those the
    processor's signature names) and go to diffusers' KV processors outside a split.
    """

    def __init__(self, scope: AttentionScope) -> None:
        super().__init__(scope, Flux2AttnProcessor())
        self.double = SequenceParallelFluxProcessor(scope)
        self.single_whole = Flux2ParallelSelfAttnProcessor()

    def split(
        self,
        attn: Any,
        groups: SequenceGroups,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None,
        rotary: Any,
    ) -> Any:
        return self.double.split(attn, groups, hidden_states, encoder_hidden_states, rotary)

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        *args: Any,
        kv_cache: Any = None,
        kv_cache_mode: str | None = None,
        num_ref_tokens: int = 0,
        num_txt_tokens: int = 0,
    ) -> Any:
        single = isinstance(attn, Flux2ParallelSelfAttention)
        groups = self.scope.groups
        if kv_cache_mode is not None:
            if groups is not None:
                raise RequestError(INVALID_REQUEST, _KV_REFUSAL)
            kv = {"kv_cache": kv_cache, "kv_cache_mode": kv_cache_mode}
            if single:
                kv |= {"num_txt_tokens": num_txt_tokens, "num_ref_tokens": num_ref_tokens}
                return Flux2KVParallelSelfAttnProcessor()(attn, hidden_states, *args, **kv)
            kv["num_ref_tokens"] = num_ref_tokens
            return Flux2KVAttnProcessor()(attn, hidden_states, *args, **kv)
        if not single:
            return super().__call__(attn, hidden_states, *args)
        mask, rotary = (*args, None, None)[:2]
        if groups is None:
            return self.single_whole(attn, hidden_states, mask, rotary)
        if mask is not None:
            raise RequestError(INVALID_REQUEST, "sequence parallel does not take attention masks")
        return _single_split(attn, groups, hidden_states, rotary)


class Flux2Cut(FluxCut):
    """FLUX.1's cut (tokens and ids sliced before the call, the sample gathered after
    it); FLUX.2's ids are 4-axis and batched, every image's the same."""

    def lengths(self, module: Any, call: inspect.BoundArguments) -> list[tuple[str, int]]:
        if call.arguments.get("kv_cache_mode") is not None:
            raise RequestError(INVALID_REQUEST, _KV_REFUSAL)
        return super().lengths(module, call)

    def run(self, module: Any, forward: Forward, call: inspect.BoundArguments, piece: Piece) -> Any:
        output = super().run(module, forward, call, piece)
        if isinstance(output, tuple):
            return output
        return Flux2Transformer2DModelOutput(sample=output.sample)
