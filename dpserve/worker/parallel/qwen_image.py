"""How a Qwen-Image transformer (``QwenImageTransformer2DModel``; Qwen-Image-Edit's too) is
split across a gang.

- Tensor parallel (``qwen_image_plan``): attention heads are split (the image and text
  q/k/v column, both output projections row), so are both streams' MLPs; the AdaLN
  modulations (``img_mod``, ``txt_mod``: a third of a block's weights) are split by output
  and gathered, and so are the timestep MLP and the output norm's modulation. The
  input embedders and the output projection stay whole.
- Sequence parallel (``QwenCut``): Qwen makes its rotary angles inside its forward, from the
  image grid and the text length, so the cut is made there by hooks, like Wan's: the text is
  first padded to a multiple of the split with keys masked out (Qwen's prompts have any
  length, and a batch's shorter prompts are padded and masked already), then the angles and
  the first block's image and text tokens are narrowed to this rank's, each block's text
  mask to this rank's text, and the output projection's tokens are gathered. Every rank
  attends its own text and image tokens (no rank redoes another's) through
  ``parallel_attention``, its keys' mask travelling with them. Padded tokens' outputs are
  never read: the transformer returns the image stream only.

  Qwen-Image-Edit appends the reference images' latents to the output's (``img_shapes``
  holds one grid per image, and the rotary table runs over all of them in that order), so
  the cut narrows output and reference tokens as one sequence, angles alike; a rank's
  share may hold both. The reference's grid comes from the pipeline (about 1024x1024
  pixels at the image's aspect, even sides), so its token count divides by 4.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from diffusers.models.transformers.transformer_qwenimage import (
    QwenDoubleStreamAttnProcessor2_0,
    apply_rotary_emb_qwen,
)

from dpserve.contract.protocol import INVALID_REQUEST, RequestError
from dpserve.worker.parallel.attention import parallel_attention
from dpserve.worker.parallel.sequence import AttentionScope, Piece
from dpserve.worker.parallel.tensor import Shard

COLUMN, ROW, GATHERED = Shard("column"), Shard("row"), Shard("gathered")
Forward = Callable[..., Any]


def qwen_image_plan(transformer: Any) -> dict[str, Shard]:
    plan: dict[str, Shard] = {}
    for i, _ in enumerate(transformer.transformer_blocks):
        p = f"transformer_blocks.{i}"
        for name in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"):
            plan[f"{p}.attn.{name}"] = COLUMN
        plan[f"{p}.attn.to_out.0"] = ROW
        plan[f"{p}.attn.to_add_out"] = ROW
        for mlp in ("img_mlp", "txt_mlp"):
            plan[f"{p}.{mlp}.net.0.proj"] = COLUMN
            plan[f"{p}.{mlp}.net.2"] = ROW
        plan[f"{p}.img_mod.1"] = GATHERED
        plan[f"{p}.txt_mod.1"] = GATHERED
    # The timestep's MLP (column then row around its SiLU) and the output norm's
    # modulation: small at Qwen-Image's width, a tenth of a tiny model's weights.
    plan["time_text_embed.timestep_embedder.linear_1"] = COLUMN
    plan["time_text_embed.timestep_embedder.linear_2"] = ROW
    plan["norm_out.linear"] = GATHERED
    return plan


def _rotate(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Qwen's rotary embedding (complex angles, (S, D/2)) on (B, S, H, D)."""
    turned: Any = apply_rotary_emb_qwen(x, angles, use_real=False)
    return turned


class SequenceParallelQwenProcessor:
    """Qwen's joint text-image attention with the attention spread over the sp ranks;
    diffusers' own outside a split call.

    Heads are counted from the head width, so the projections may be tp-split. diffusers
    calls it by keyword (its Attention passes the arguments the signature names).
    """

    def __init__(self, scope: AttentionScope) -> None:
        self.scope = scope
        self.whole: Any = QwenDoubleStreamAttnProcessor2_0()

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_hidden_states_mask: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: Any = None,
    ) -> Any:
        groups = self.scope.groups
        if groups is None or encoder_hidden_states is None:
            return self.whole(
                attn,
                hidden_states,
                encoder_hidden_states,
                encoder_hidden_states_mask,
                attention_mask,
                image_rotary_emb,
            )
        if attention_mask is not None:
            raise RequestError(
                INVALID_REQUEST, "sequence parallel takes Qwen's text mask, not an attention mask"
            )
        head_dim = attn.inner_dim // attn.heads

        def heads(x: torch.Tensor) -> torch.Tensor:
            return x.unflatten(-1, (-1, head_dim))

        query, key, value = (heads(f(hidden_states)) for f in (attn.to_q, attn.to_k, attn.to_v))
        text = encoder_hidden_states
        text_q, text_k, text_v = (
            heads(f(text)) for f in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)
        )
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        if attn.norm_added_q is not None:
            text_q = attn.norm_added_q(text_q)
        if attn.norm_added_k is not None:
            text_k = attn.norm_added_k(text_k)
        if image_rotary_emb is not None:  # this rank's tokens' angles (QwenCut)
            image_angles, text_angles = image_rotary_emb
            query, key = _rotate(query, image_angles), _rotate(key, image_angles)
            text_q, text_k = _rotate(text_q, text_angles), _rotate(text_k, text_angles)
        key_mask = None
        if encoder_hidden_states_mask is not None:  # this rank's text's (QwenCut)
            image_mask = encoder_hidden_states_mask.new_ones(hidden_states.shape[:2])
            key_mask = torch.cat([encoder_hidden_states_mask, image_mask], dim=1).bool()
        out = parallel_attention(
            torch.cat([text_q, query], dim=1),
            torch.cat([text_k, key], dim=1),
            torch.cat([text_v, value], dim=1),
            groups,
            key_mask=key_mask,
        )
        out = out.flatten(2, 3).to(query.dtype)
        text_len = text.shape[1]
        image_out = attn.to_out[0](out[:, text_len:].contiguous())
        if len(attn.to_out) > 1:
            image_out = attn.to_out[1](image_out)
        return image_out, attn.to_add_out(out[:, :text_len].contiguous())


class QwenCut:
    """Cut a Qwen-Image call between its embedders and its blocks (module docstring)."""

    def lengths(self, module: Any, call: inspect.BoundArguments) -> list[tuple[str, int]]:
        if call.arguments.get("controlnet_block_samples") is not None:
            raise RequestError(INVALID_REQUEST, "sequence parallel does not take ControlNet inputs")
        # The text is padded to fit (run); the image tokens must divide. An edit's are
        # the output's and then each reference image's (one grid each in img_shapes).
        shapes = call.arguments.get("img_shapes") or [[]]
        what = "image" if len(shapes[0]) < 2 else "output and reference image"
        return [(what, call.arguments["hidden_states"].shape[1])]

    def run(self, module: Any, forward: Forward, call: inspect.BoundArguments, piece: Piece) -> Any:
        degree = piece.degree
        text = call.arguments["encoder_hidden_states"]
        mask = call.arguments.get("encoder_hidden_states_mask")
        pad = -text.shape[1] % degree
        if pad:
            b = text.shape[0]
            text = torch.cat([text, text.new_zeros(b, pad, text.shape[2])], dim=1)
            real = torch.ones(b, text.shape[1] - pad, dtype=torch.bool, device=text.device)
            mask = real if mask is None else mask.bool()
            mask = torch.cat([mask, mask.new_zeros(b, pad)], dim=1)
            call.arguments["encoder_hidden_states"] = text
            call.arguments["encoder_hidden_states_mask"] = mask

        def own_angles(_: Any, __: Any, angles: tuple[torch.Tensor, ...]) -> tuple[Any, ...]:
            return tuple(piece.take(a, 0) for a in angles)  # (image, text), (S, D/2) each

        def own_tokens(_: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            for name in ("hidden_states", "encoder_hidden_states"):
                kwargs[name] = piece.take(kwargs[name], 1)
            return args, kwargs

        def own_masks(_: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            for name in ("encoder_hidden_states_mask", "modulate_index"):
                if kwargs.get(name) is not None:  # (B, text) and (B, image)
                    kwargs[name] = piece.take(kwargs[name], 1)
            return args, kwargs

        def all_tokens(_: Any, __: Any, out: torch.Tensor) -> torch.Tensor:
            return piece.gather(out, 1)

        hooks = [
            module.pos_embed.register_forward_hook(own_angles),
            module.transformer_blocks[0].register_forward_pre_hook(own_tokens, with_kwargs=True),
            *(
                block.register_forward_pre_hook(own_masks, with_kwargs=True)
                for block in module.transformer_blocks
            ),
            module.proj_out.register_forward_hook(all_tokens),
        ]
        try:
            return forward(*call.args, **call.kwargs)
        finally:
            for hook in hooks:
                hook.remove()
