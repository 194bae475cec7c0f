"""How a Wan video transformer (``WanTransformer3DModel``) is split along its sequence.

Wan makes its tokens inside its forward: the video latent is patched into
frames x rows x columns tokens, and rotary angles come from the same grid. So the
cut is made there, for one call, by hooks (``WanCut``): the rotary angles and the
first block's input are narrowed to this rank's tokens, every block runs on its
slice, and the output projection's tokens are gathered before the forward folds
them back into a latent. Self-attention exchanges through ``parallel_attention``;
cross-attention needs no exchange (each token attends to the whole prompt, which
every rank holds), nor do the norms and feed-forward (per token).

Text tokens are not split, and per-token timesteps (Wan 2.2's TI2V) are refused at
load: their conditioning would need the same cut.

Tensor parallel (``wan_plan``): both attentions' q/k/v (and the image-to-video
variant's image keys and values) are split by heads, their output projections by
rows, the feed-forward column then row. Wan's q/k norm is one RMSNorm across all
heads, so on a rank's heads it is a ``norm`` shard: its weight cut like the
columns, its mean of squares summed over the tp ranks. The condition embedder
(timestep, text, image), the patch embedding and the output projection stay whole.
The attention counts a rank's heads from its projection's width
(``_LocalHeads``), so diffusers' own processor runs on the pieces unchanged.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from diffusers.models.transformers.transformer_wan import WanAttnProcessor

from dpserve.contract.protocol import (
    INVALID_REQUEST,
    RequestError,
)
from dpserve.worker.parallel.attention import SequenceGroups, parallel_attention
from dpserve.worker.parallel.sequence import AttentionScope, Piece, SplitAttention
from dpserve.worker.parallel.tensor import Shard

Forward = Callable[..., Any]
COLUMN, ROW, NORM = Shard("column"), Shard("row"), Shard("norm")


def wan_plan(transformer: Any) -> dict[str, Shard]:
    plan: dict[str, Shard] = {}
    for i, block in enumerate(transformer.blocks):
        for attn in ("attn1", "attn2"):
            p = f"blocks.{i}.{attn}"
            for name in ("to_q", "to_k", "to_v"):
                plan[f"{p}.{name}"] = COLUMN
            plan[f"{p}.to_out.0"] = ROW
            plan[f"{p}.norm_q"] = NORM
            plan[f"{p}.norm_k"] = NORM
        if block.attn2.add_k_proj is not None:  # image-to-video (Wan 2.1 I2V)
            plan[f"blocks.{i}.attn2.add_k_proj"] = COLUMN
            plan[f"blocks.{i}.attn2.add_v_proj"] = COLUMN
            plan[f"blocks.{i}.attn2.norm_added_k"] = NORM
        plan[f"blocks.{i}.ffn.net.0.proj"] = COLUMN
        plan[f"blocks.{i}.ffn.net.2"] = ROW
    return plan


def local_heads(attn: Any) -> int:
    """The heads this rank's pieces of ``attn`` hold (all of them without tp)."""
    return int(attn.to_q.out_features) * int(attn.heads) // int(attn.inner_dim)


class _LocalHeads:
    """``attn`` as diffusers' processor sees it, with this rank's head count."""

    def __init__(self, attn: Any, heads: int) -> None:
        self._attn = attn
        self.heads = heads

    def __getattr__(self, name: str) -> Any:
        return getattr(self._attn, name)


class _WanWhole:
    """diffusers' Wan processor, on a tp rank's heads where the projections are cut."""

    def __init__(self) -> None:
        self.processor = WanAttnProcessor()

    def __call__(self, attn: Any, *args: Any) -> Any:
        heads = local_heads(attn)
        seen: Any = attn if heads == attn.heads else _LocalHeads(attn, heads)
        return self.processor(seen, *args)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Wan's rotary embedding on (B, S, H, D): interleaved pairs turned by each angle."""
    even, odd = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    turned = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return turned.flatten(-2).type_as(x)


class SequenceParallelWanProcessor(SplitAttention):
    """Wan's self-attention spread over the sp ranks; its cross-attention (each token
    to the whole prompt, which every rank holds) is diffusers' own."""

    def __init__(self, scope: AttentionScope) -> None:
        super().__init__(scope, _WanWhole())

    def exchanges(self, encoder_hidden_states: torch.Tensor | None) -> bool:
        return encoder_hidden_states is None

    def split(
        self,
        attn: Any,
        groups: SequenceGroups,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None,
        rotary: Any,  # (cos, sin), this rank's tokens' (WanCut)
    ) -> Any:
        def heads(x: torch.Tensor) -> torch.Tensor:
            return x.unflatten(2, (local_heads(attn), -1))

        query = heads(attn.norm_q(attn.to_q(hidden_states)))
        key = heads(attn.norm_k(attn.to_k(hidden_states)))
        value = heads(attn.to_v(hidden_states))
        if rotary is not None:
            query, key = _rotate(query, *rotary), _rotate(key, *rotary)
        out = parallel_attention(query, key, value, groups).flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))


class WanCut:
    """Cut a Wan call between its patching and its blocks (module docstring)."""

    def lengths(self, module: Any, call: inspect.BoundArguments) -> list[tuple[str, int]]:
        if call.arguments["timestep"].ndim != 1:
            raise RequestError(INVALID_REQUEST, "per-token timesteps are not sequence-split")
        frames, height, width = call.arguments["hidden_states"].shape[2:]
        p_t, p_h, p_w = module.config.patch_size
        return [("video", (frames // p_t) * (height // p_h) * (width // p_w))]

    def run(self, module: Any, forward: Forward, call: inspect.BoundArguments, piece: Piece) -> Any:
        def own_angles(_: Any, __: Any, angles: tuple[torch.Tensor, ...]) -> tuple[Any, ...]:
            return tuple(piece.take(a, 1) for a in angles)  # (1, S, 1, D) each

        def own_tokens(_: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if args:
                return (piece.take(args[0], 1), *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": piece.take(kwargs["hidden_states"], 1)}

        def all_tokens(_: Any, __: Any, out: torch.Tensor) -> torch.Tensor:
            return piece.gather(out, 1)

        hooks = [
            module.rope.register_forward_hook(own_angles),
            module.blocks[0].register_forward_pre_hook(own_tokens, with_kwargs=True),
            module.proj_out.register_forward_hook(all_tokens),
        ]
        try:
            return forward(*call.args, **call.kwargs)
        finally:
            for hook in hooks:
                hook.remove()
