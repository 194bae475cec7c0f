"""How a Stable Diffusion 3 transformer (``SD3Transformer2DModel``, SD3 and SD3.5) is split.

- Sequence parallel (``SD3Cut``): SD3 takes the latent image and patches it inside its
  forward, so the cut is made there, for one call, by hooks (as ``wan.WanCut``): the
  patch embedding's tokens and the embedded text tokens (77 CLIP + the T5 length for
  the real models: the pipeline pads every prompt to both) are narrowed to this rank's
  slices, every block runs on its slices, and the output projection's tokens are
  gathered before the forward folds them back into a latent. The joint attention of a
  block (image and text tokens together) exchanges through ``parallel_attention``, and
  so does SD3.5's second attention (``attn2``, "dual attention": image tokens only).
  The last block is ``context_pre_only``: its text stream's attention output is not
  projected, and the block returns no text (nothing to gather).
- Tensor parallel (``sd3_plan``): both attentions' q/k/v (and the text stream's) are
  split by heads (column) with their outputs row-wise, both MLPs column/row, and the
  AdaLN modulation layers by output, gathered. The patch, timestep and text embedders,
  the final norm and projection stay whole.

**Decision:** outside a split call an unsplit transformer runs diffusers' own
``JointAttnProcessor2_0`` (CFG-only gangs stay bitwise equal to one rank); a tp piece
runs this processor with the local exchange-free attention, because diffusers' counts
heads from ``attn.heads`` (the whole model's) and would fold a piece's features into
the wrong heads.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from diffusers.models.attention_processor import JointAttnProcessor2_0

from dpserve.contract.protocol import INVALID_REQUEST, RequestError
from dpserve.worker.parallel.attention import SequenceGroups, parallel_attention
from dpserve.worker.parallel.sequence import AttentionScope, Piece, SplitAttention
from dpserve.worker.parallel.tensor import Shard

COLUMN, ROW, GATHERED = Shard("column"), Shard("row"), Shard("gathered")
Forward = Callable[..., Any]
_LOCAL = SequenceGroups()  # attention over this rank's tokens only: no exchange


def sd3_plan(transformer: Any) -> dict[str, Shard]:
    plan: dict[str, Shard] = {}
    for i, block in enumerate(transformer.transformer_blocks):
        p = f"transformer_blocks.{i}"
        for name in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"):
            plan[f"{p}.attn.{name}"] = COLUMN
        plan[f"{p}.attn.to_out.0"] = ROW
        if not block.context_pre_only:
            plan[f"{p}.attn.to_add_out"] = ROW
        if block.attn2 is not None:
            for name in ("to_q", "to_k", "to_v"):
                plan[f"{p}.attn2.{name}"] = COLUMN
            plan[f"{p}.attn2.to_out.0"] = ROW
        for ff in ("ff", "ff_context"):
            if getattr(block, ff) is not None:
                plan[f"{p}.{ff}.net.0.proj"] = COLUMN
                plan[f"{p}.{ff}.net.2"] = ROW
        plan[f"{p}.norm1.linear"] = GATHERED
        plan[f"{p}.norm1_context.linear"] = GATHERED
    return plan


class SequenceParallelSD3Processor(SplitAttention):
    """SD3's joint attention (image and text tokens) and SD3.5's image-only ``attn2``,
    spread over the sp ranks. Heads are counted from the head width, so the same
    processor runs on tp pieces."""

    def __init__(self, scope: AttentionScope) -> None:
        super().__init__(scope, JointAttnProcessor2_0())

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        groups = self.scope.groups
        whole = attn.to_q.out_features == attn.inner_dim  # not a tp piece
        if groups is None and whole:
            return self.whole(attn, hidden_states, encoder_hidden_states, attention_mask)
        if attention_mask is not None:
            raise RequestError(INVALID_REQUEST, "sequence and tensor parallel take no masks")
        return self.split(attn, groups or _LOCAL, hidden_states, encoder_hidden_states, None)

    def split(
        self,
        attn: Any,
        groups: SequenceGroups,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None,
        rotary: Any,  # SD3 adds its positions at the patch embedding: none here
    ) -> Any:
        head_dim = attn.inner_dim // attn.heads

        def heads(x: torch.Tensor) -> torch.Tensor:
            return x.unflatten(-1, (-1, head_dim))

        def norm(layer: Any, x: torch.Tensor) -> torch.Tensor:
            return x if layer is None else layer(x)

        query = norm(attn.norm_q, heads(attn.to_q(hidden_states)))
        key = norm(attn.norm_k, heads(attn.to_k(hidden_states)))
        value = heads(attn.to_v(hidden_states))
        if encoder_hidden_states is not None:  # joint: image tokens, then text tokens
            text_q = norm(attn.norm_added_q, heads(attn.add_q_proj(encoder_hidden_states)))
            text_k = norm(attn.norm_added_k, heads(attn.add_k_proj(encoder_hidden_states)))
            text_v = heads(attn.add_v_proj(encoder_hidden_states))
            query = torch.cat([query, text_q], dim=1)
            key = torch.cat([key, text_k], dim=1)
            value = torch.cat([value, text_v], dim=1)
        out = parallel_attention(query, key, value, groups).flatten(2, 3).to(query.dtype)
        if encoder_hidden_states is None:
            return attn.to_out[1](attn.to_out[0](out))
        image_len = hidden_states.shape[1]
        image_out, text_out = out[:, :image_len], out[:, image_len:]
        image_out = attn.to_out[1](attn.to_out[0](image_out.contiguous()))
        if attn.context_pre_only:
            return image_out, text_out  # the last block drops its text stream
        return image_out, attn.to_add_out(text_out.contiguous())


class SD3Cut:
    """Cut an SD3 call between its embedders and its blocks (module docstring)."""

    def lengths(self, module: Any, call: inspect.BoundArguments) -> list[tuple[str, int]]:
        if call.arguments.get("block_controlnet_hidden_states") is not None:
            raise RequestError(INVALID_REQUEST, "sequence parallel does not take ControlNet")
        height, width = call.arguments["hidden_states"].shape[-2:]
        patch = module.config.patch_size
        text = call.arguments["encoder_hidden_states"].shape[1]
        return [("image", (height // patch) * (width // patch)), ("text", text)]

    def run(self, module: Any, forward: Forward, call: inspect.BoundArguments, piece: Piece) -> Any:
        def own_tokens(_: Any, __: Any, tokens: torch.Tensor) -> torch.Tensor:
            return piece.take(tokens, 1)

        def all_tokens(_: Any, __: Any, out: torch.Tensor) -> torch.Tensor:
            return piece.gather(out, 1)

        hooks = [
            module.pos_embed.register_forward_hook(own_tokens),
            module.context_embedder.register_forward_hook(own_tokens),
            module.proj_out.register_forward_hook(all_tokens),
        ]
        try:
            return forward(*call.args, **call.kwargs)
        finally:
            for hook in hooks:
                hook.remove()
