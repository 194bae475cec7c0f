"""Seeded, offline-built FLUX.2 pipelines (``make-tiny-model --variant flux2``).

**Decision:** the tiny FLUX.2 is a ``Flux2KleinPipeline`` (FLUX.2 [klein]: a Qwen3
text encoder, a Qwen2 BPE tokenizer with a chat template) rather than a
``Flux2Pipeline`` ([dev]: Mistral3, whose processor also needs a Pixtral image
processor and a tekken tokenizer to build offline). Both drive the same
``Flux2Transformer2DModel``, which is what the gang splits, and klein (not
step-distilled) has guidance CFG, so CFG gangs have two branches to split.

The text encoder is narrow but 27 layers deep: the pipeline stacks the hidden
states of layers 9, 18 and 27 (its default ``text_encoder_out_layers``), so the
transformer's ``joint_attention_dim`` is three times the encoder's width.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import torch
from diffusers.models.autoencoders.autoencoder_kl_flux2 import AutoencoderKLFlux2
from diffusers.models.transformers.transformer_flux2 import Flux2Transformer2DModel
from diffusers.pipelines.flux2.pipeline_flux2_klein import Flux2KleinPipeline
from diffusers.schedulers.scheduling_flow_match_euler_discrete import (
    FlowMatchEulerDiscreteScheduler,
)
from transformers import Qwen2Tokenizer, Qwen3Config, Qwen3ForCausalLM

from dpserve.worker.tiny_model import _WORDS, _atomic_dir, _bytes_to_unicode, _perturb, _seeded

_LATENT_CHANNELS = 4  # the transformer sees 2x2 patches of them: 16 input channels
_ENCODER_LAYERS = 27  # the pipeline reads hidden states 9, 18 and 27
_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")
# Qwen3's chat template, cut to what the pipeline renders: one user turn, the
# assistant's turn opened, thinking switched off (an empty think block).
_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


@dataclass(frozen=True)
class Flux2Variant:
    num_layers: int
    num_single_layers: int
    attention_head_dim: int
    num_attention_heads: int
    axes_dims_rope: tuple[int, int, int, int]  # T, H, W, L: sums to the head dim
    text_dim: int = 16


FLUX2_VARIANTS: Mapping[str, Flux2Variant] = MappingProxyType(
    {
        # 4 heads, so tp x ulysses layouts of 4 ranks can split them.
        "flux2": Flux2Variant(1, 2, 16, 4, (4, 4, 4, 4)),
        # For the CPU benchmark (bench/parallel_modes.py --family flux2).
        "flux2-small": Flux2Variant(2, 6, 64, 8, (16, 16, 16, 16), text_dim=32),
    }
)


def _qwen2_tokenizer() -> Qwen2Tokenizer:
    """A byte-level BPE over the byte alphabet, with each of ``_WORDS`` (and its
    space-led form) merged into one token, and Qwen's chat tokens."""
    alphabet = list(_bytes_to_unicode().values())
    vocab: dict[str, int] = {c: i for i, c in enumerate(alphabet)}
    merges: list[tuple[str, str]] = []
    space = _bytes_to_unicode()[ord(" ")]
    for word in (*_WORDS, *(space + w for w in _WORDS)):
        left = word[0]
        for ch in word[1:]:
            merged = left + ch
            if merged not in vocab:
                merges.append((left, ch))
                vocab[merged] = len(vocab)
            left = merged
    for token in _SPECIAL:
        vocab[token] = len(vocab)
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,  # type: ignore[arg-type]  # the BPE backend wants (left, right) pairs
        model_max_length=512,
    )
    tokenizer.add_special_tokens({"additional_special_tokens": list(_SPECIAL[1:])})
    tokenizer.chat_template = _CHAT_TEMPLATE
    return tokenizer


def transformer_config(variant: str) -> dict[str, object]:
    v = FLUX2_VARIANTS[variant]
    return {
        "patch_size": 1,
        "in_channels": 4 * _LATENT_CHANNELS,
        "num_layers": v.num_layers,
        "num_single_layers": v.num_single_layers,
        "attention_head_dim": v.attention_head_dim,
        "num_attention_heads": v.num_attention_heads,
        "joint_attention_dim": 3 * v.text_dim,
        "timestep_guidance_channels": 32,
        "axes_dims_rope": v.axes_dims_rope,
        "guidance_embeds": False,  # klein: no distilled guidance embedding
    }


def build(variant: str, seed: int) -> Flux2KleinPipeline:
    v = FLUX2_VARIANTS[variant]
    tokenizer = _qwen2_tokenizer()

    torch.manual_seed(_seeded(seed, "text_encoder"))
    text_encoder = Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=len(tokenizer),
            hidden_size=v.text_dim,
            intermediate_size=2 * v.text_dim,
            num_hidden_layers=_ENCODER_LAYERS,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=v.text_dim // 2,
            max_position_embeddings=1024,
            tie_word_embeddings=True,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    )

    torch.manual_seed(_seeded(seed, "transformer"))
    transformer = Flux2Transformer2DModel(**transformer_config(variant))

    torch.manual_seed(_seeded(seed, "vae"))
    vae = AutoencoderKLFlux2(
        block_out_channels=(32, 32, 64, 64),
        layers_per_block=1,
        latent_channels=_LATENT_CHANNELS,
        norm_num_groups=32,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )

    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
        time_shift_type="exponential",
    )

    modules = {"text_encoder": text_encoder, "transformer": transformer, "vae": vae}
    for name, module in modules.items():
        if any(p.dtype != torch.float32 for p in module.parameters()):
            module.float()  # only if the caller changed torch's default dtype
        _perturb(module, _seeded(seed, name + ":perturb"), 0.02)
        module.eval()

    return Flux2KleinPipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
        is_distilled=False,
    )


# Every linear layer of the blocks a LoRA may adapt, the fused ones included (the single
# blocks' q/k/v+MLP input and their attention+MLP output, the SwiGLU inputs), so a
# tensor-parallel rank's adapters must be cut in the same packed blocks as its weights.
FUSED_LORA_TARGETS: tuple[str, ...] = (
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
    "ff.linear_in",
    "ff.linear_out",
    "ff_context.linear_in",
    "ff_context.linear_out",
    "attn.to_qkv_mlp_proj",
    "attn.to_out",
)


def build_lora(out_dir: Path, model_dir: Path, seed: int = 0, rank: int = 4) -> Path:
    """A random diffusers-format LoRA over every block layer of ``model_dir``'s FLUX.2
    transformer, fused ones included (``build_tiny_lora`` adapts attention only)."""
    config = Flux2Transformer2DModel.load_config(Path(model_dir) / "transformer")
    with torch.device("meta"):
        skeleton = Flux2Transformer2DModel.from_config(config)
    suffixes = tuple("." + t for t in FUSED_LORA_TARGETS)
    gen = torch.Generator().manual_seed(_seeded(seed, f"flux2-lora:{rank}"))
    layers: dict[str, torch.nn.Module | torch.Tensor] = {}
    for name, module in sorted(skeleton.named_modules(), key=lambda item: item[0]):
        if isinstance(module, torch.nn.Linear) and name.endswith(suffixes):
            a = torch.randn(rank, module.in_features, generator=gen) / module.in_features**0.5
            b = torch.randn(module.out_features, rank, generator=gen) / rank**0.5
            layers[f"{name}.lora_A.weight"] = a.contiguous()
            layers[f"{name}.lora_B.weight"] = b.contiguous()
    with _atomic_dir(Path(out_dir)) as tmp:
        Flux2KleinPipeline.save_lora_weights(tmp, transformer_lora_layers=layers)
    return Path(out_dir)
