"""LoRA adapters on a diffusers pipeline: load, activate, merge and unmerge exactly.

diffusers' ``unfuse_lora`` subtracts the delta it added, which does not give the
original weights back bit for bit; a replica that merged and unmerged would then
disagree with one that never did. Merging therefore keeps a copy of the base
weights of the adapted layers (only those: a small fraction of the model) and
unmerging restores that copy.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from pathlib import Path

import torch
from peft.tuners.lora import LoraLayer

from dpserve.worker.parallel import ModelParallel
from dpserve.worker.parallel.encoders import relayed
from dpserve.worker.pipeline import Pipeline
from dpserve.worker.weights import modules_of


@dataclass
class LoraAdapters:
    pipe: Pipeline
    parallel: ModelParallel
    loaded: dict[str, str] = field(default_factory=dict)  # nickname -> path
    active: dict[str, float] = field(default_factory=dict)  # nickname -> strength
    merged_strength: float | None = None  # the strength the active adapters are merged at
    _base: dict[int, torch.Tensor] = field(default_factory=dict)  # id(param) -> copy

    @property
    def merged(self) -> bool:
        return self.merged_strength is not None

    def load(self, nickname: str, path: str, folder: Path) -> None:
        """Load the adapter in ``folder`` (``path`` resolved and checked) as ``nickname``;
        from safetensors only (diffusers never falls back to a pickle when told so)."""
        if nickname in self.loaded:
            self.unload(nickname)
        if self.parallel.sharded or relayed(getattr(self.pipe, "text_encoder", None)):
            self._load_split(nickname, str(folder))
        else:
            self.pipe.load_lora_weights(str(folder), adapter_name=nickname, use_safetensors=True)
        self.parallel.adapters_changed(self.pipe.transformer)
        self.loaded[nickname] = path  # as the state names it

    def unload(self, nickname: str) -> None:
        self.pipe.delete_adapters(nickname)
        del self.loaded[nickname]
        self.active.pop(nickname, None)
        self.parallel.adapters_changed(self.pipe.transformer)

    def _load_split(self, nickname: str, path: str) -> None:
        """diffusers' two loading steps: the transformer's adapters cut to this rank's
        piece (peft sizes them from the already split layers), and the text encoder's
        only where the encoder is held (not a stand-in for the output rank's)."""
        pipe = self.pipe
        # Flux's loader takes network alphas; FLUX.2's and others' have none to return.
        load_params = inspect.signature(pipe.load_lora_into_transformer).parameters
        takes = inspect.signature(pipe.lora_state_dict).parameters
        alphas_kw = "network_alphas" in load_params and "return_alphas" in takes
        loaded = pipe.lora_state_dict(
            path, return_alphas=alphas_kw, return_lora_metadata=True, use_safetensors=True
        )
        state, alphas, metadata = loaded if alphas_kw else (loaded[0], None, loaded[1])
        prefix = f"{getattr(pipe, 'transformer_name', 'transformer')}."
        pipe.load_lora_into_transformer(
            self.parallel.shard_lora(pipe.transformer, state, prefix),
            **({"network_alphas": alphas} if alphas_kw else {}),
            transformer=pipe.transformer,
            adapter_name=nickname,
            metadata=metadata,
            _pipeline=pipe,
        )
        text = getattr(pipe, "text_encoder_name", "text_encoder")
        text_keys = any(k.startswith(f"{text}.") for k in state)
        if text_keys and not relayed(getattr(pipe, text, None)):
            pipe.load_lora_into_text_encoder(
                state,
                network_alphas=alphas,
                text_encoder=getattr(pipe, text),
                prefix=text,
                lora_scale=pipe.lora_scale,
                adapter_name=nickname,
                metadata=metadata,
                _pipeline=pipe,
            )

    def activate(self, strengths: dict[str, float]) -> None:
        self.pipe.set_adapters(list(strengths), adapter_weights=list(strengths.values()))
        self.active = dict(strengths)

    def merge(self, strength: float) -> None:
        self._base = {id(p): p.detach().clone() for p in self._adapted_base_params()}
        self.pipe.fuse_lora(lora_scale=strength, adapter_names=list(self.active))
        self.merged_strength = strength

    def unmerge(self) -> None:
        self.pipe.unfuse_lora()
        with torch.no_grad():
            for param in self._adapted_base_params():
                param.copy_(self._base[id(param)])
        self._base = {}
        self.merged_strength = None

    def drop_all(self) -> list[str]:
        """Unload every adapter; returns the nicknames that were loaded."""
        dropped = sorted(self.loaded)
        if self.merged:
            self.unmerge()
        if dropped:
            self.pipe.unload_lora_weights()
            self.parallel.adapters_changed(self.pipe.transformer)
        self.loaded.clear()
        self.active.clear()
        return dropped

    def _adapted_base_params(self) -> list[torch.nn.Parameter]:
        params: list[torch.nn.Parameter] = []
        for module in modules_of(self.pipe.components).values():
            for layer in module.modules():
                if isinstance(layer, LoraLayer):
                    params.extend(layer.get_base_layer().parameters(recurse=False))
        return params
