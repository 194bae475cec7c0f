"""How a Flux transformer (``FluxTransformer2DModel``) is split across a gang.

- Tensor parallel: the plan below. Attention heads are split (q/k/v column,
  output row), so are both MLPs and the single blocks' fused MLP; the AdaLN
  modulation layers, a large share of Flux's weights, are split by output and
  gathered (their output is a few vectors per image). Embedders, the final norm
  and projection stay whole: they are small.
- Sequence parallel (``FluxCut``): the transformer's inputs are cut along the
  sequence (image tokens and text tokens, and their position ids), every block
  runs on its own slice, attention runs through ``parallel_attention``, and the
  output is gathered back. Rotary embeddings come from each slice's own ids, so they are
  right before any exchange.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

from dpserve.worker.parallel.attention import SequenceGroups, parallel_attention
from dpserve.worker.parallel.sequence import AttentionScope, Piece, SplitAttention
from dpserve.worker.parallel.tensor import Shard

COLUMN, ROW, GATHERED = Shard("column"), Shard("row"), Shard("gathered")
Forward = Callable[..., Any]


def flux_plan(transformer: Any) -> dict[str, Shard]:
    plan: dict[str, Shard] = {}
    for i, _ in enumerate(transformer.transformer_blocks):
        p = f"transformer_blocks.{i}"
        for name in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"):
            plan[f"{p}.attn.{name}"] = COLUMN
        plan[f"{p}.attn.to_out.0"] = ROW
        plan[f"{p}.attn.to_add_out"] = ROW
        for ff in ("ff", "ff_context"):
            plan[f"{p}.{ff}.net.0.proj"] = COLUMN
            plan[f"{p}.{ff}.net.2"] = ROW
        plan[f"{p}.norm1.linear"] = GATHERED
        plan[f"{p}.norm1_context.linear"] = GATHERED
    for i, block in enumerate(transformer.single_transformer_blocks):
        p = f"single_transformer_blocks.{i}"
        for name in ("to_q", "to_k", "to_v"):
            plan[f"{p}.attn.{name}"] = COLUMN
        plan[f"{p}.proj_mlp"] = COLUMN
        # Its input is cat([attention output, MLP hidden]), each split on its own.
        dim = block.proj_out.out_features
        plan[f"{p}.proj_out"] = Shard("row", (dim, block.mlp_hidden_dim))
        plan[f"{p}.norm.linear"] = GATHERED
    return plan


class SequenceParallelFluxProcessor(SplitAttention):
    """Flux's joint attention with the attention itself spread over the sp ranks.

    Heads are counted from ``head_dim``, so the projections may be tp-split.
    """

    def __init__(self, scope: AttentionScope) -> None:
        super().__init__(scope, FluxAttnProcessor())

    def split(
        self,
        attn: Any,
        groups: SequenceGroups,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None,
        rotary: Any,  # (cos, sin)
    ) -> Any:
        def heads(x: torch.Tensor) -> torch.Tensor:
            return x.unflatten(-1, (-1, attn.head_dim))

        query = attn.norm_q(heads(attn.to_q(hidden_states)))
        key = attn.norm_k(heads(attn.to_k(hidden_states)))
        value = heads(attn.to_v(hidden_states))
        joint = encoder_hidden_states is not None and attn.added_kv_proj_dim is not None
        if joint:
            assert encoder_hidden_states is not None
            text_q = attn.norm_added_q(heads(attn.add_q_proj(encoder_hidden_states)))
            text_k = attn.norm_added_k(heads(attn.add_k_proj(encoder_hidden_states)))
            text_v = heads(attn.add_v_proj(encoder_hidden_states))
            query = torch.cat([text_q, query], dim=1)
            key = torch.cat([text_k, key], dim=1)
            value = torch.cat([text_v, value], dim=1)
        if rotary is not None:
            query = apply_rotary_emb(query, rotary, sequence_dim=1)
            key = apply_rotary_emb(key, rotary, sequence_dim=1)
        out = parallel_attention(query, key, value, groups).flatten(2, 3).to(query.dtype)
        if not joint:
            return out
        assert encoder_hidden_states is not None
        text_len = encoder_hidden_states.shape[1]
        text_out, image_out = out[:, :text_len], out[:, text_len:]
        image_out = attn.to_out[1](attn.to_out[0](image_out.contiguous()))
        return image_out, attn.to_add_out(text_out.contiguous())


class FluxCut:
    """Flux takes its tokens as input: the image and text tokens and their position
    ids are sliced before the call, and the output sample gathered after it."""

    # (argument, sequence dimension) of FluxTransformer2DModel.forward
    INPUTS = (("hidden_states", 1), ("encoder_hidden_states", 1), ("img_ids", 0), ("txt_ids", 0))

    def _inputs(self, call: inspect.BoundArguments) -> dict[str, tuple[torch.Tensor, int]]:
        inputs = {}
        for name, dim in self.INPUTS:
            value = call.arguments.get(name)
            if isinstance(value, torch.Tensor):
                if value.ndim == 3 and name.endswith("_ids"):
                    value = value[0]  # diffusers' deprecated batched ids
                inputs[name] = (value, dim)
        return inputs

    def lengths(self, module: Any, call: inspect.BoundArguments) -> list[tuple[str, int]]:
        return [
            ("image" if name in ("hidden_states", "img_ids") else "text", value.shape[dim])
            for name, (value, dim) in self._inputs(call).items()
        ]

    def run(self, module: Any, forward: Forward, call: inspect.BoundArguments, piece: Piece) -> Any:
        for name, (value, dim) in self._inputs(call).items():
            call.arguments[name] = piece.take(value, dim)
        output = forward(*call.args, **call.kwargs)
        sample = output[0] if isinstance(output, tuple) else output.sample
        gathered = piece.gather(sample, 1)
        return (gathered,) if isinstance(output, tuple) else Transformer2DModelOutput(gathered)
