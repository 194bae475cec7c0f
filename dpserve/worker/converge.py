"""Bring one rank's pipeline to a control state (dpserve.contract.control_state), all or nothing.

The state's parts are applied in the order they depend on each other: weights
back on the device, modules reloaded (which drops adapters: they belonged to
the old modules), adapters unmerged, unloaded, loaded, activated, merged, and
weights released last. Only the steps whose part differs run, so applying the
state a rank already holds does nothing.

Every folder a state names is checked against the replica's allowed folders
(dpserve.worker.paths) when it is loaded, and loaded from its resolved path and
from safetensors only, whichever way the state arrived: an op sent straight to
the replica, or a router's whole state.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import torch

from dpserve.contract.control_state import ControlState, WeightSource, bad
from dpserve.contract.protocol import (
    INTERNAL,
    RequestError,
)
from dpserve.worker.lora import LoraAdapters
from dpserve.worker.parallel import ModelParallel
from dpserve.worker.parallel.encoders import EncoderRelay, relayed
from dpserve.worker.paths import AllowedPaths, refuse_pickles
from dpserve.worker.pipeline import DENOISERS, Pipeline
from dpserve.worker.weights import WeightOffload, modules_of, own_storage

log = logging.getLogger(__name__)
Effects = dict[str, Any]


@dataclass
class StateApplier:
    pipe: Pipeline
    boot_path: Path  # where modules without a WeightSource come from
    device: torch.device
    parallel: ModelParallel
    relay: EncoderRelay | None = None
    allow_paths: tuple[Path, ...] = ()  # besides boot_path (--allow-path)
    allowed: AllowedPaths = field(init=False)
    loras: LoraAdapters = field(init=False)
    offload: WeightOffload = field(init=False)
    weights: dict[str, WeightSource] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.allowed = AllowedPaths.of(self.boot_path, self.allow_paths)
        self.loras = LoraAdapters(self.pipe, self.parallel)
        self.offload = WeightOffload(self.device)

    def state(self) -> ControlState:
        """What this rank holds, read from the parts themselves."""
        return ControlState(
            weights=dict(self.weights),
            loras=dict(self.loras.loaded),
            active=dict(self.loras.active),
            merged=self.loras.merged_strength,
            released=self.offload.released,
        )

    def source_of(self, module: str) -> Path:
        source = self.weights.get(module)
        return Path(source.path) if source is not None else self.boot_path

    def apply(self, target: ControlState) -> Effects:
        """Every step ``target`` needs; returns what was done (``actions`` and details)."""
        actions: list[str] = []
        effects: Effects = {"actions": actions}
        now = self.state()
        # Any other change needs the weights on the device first.
        if now.released and (_resident(now) != _resident(target) or not target.released):
            self.offload.resume(modules_of(self.pipe.components))
            actions.append("resumed")
        if now.weights != target.weights:
            reloaded = sorted(self._to_load(now.weights, target.weights))
            effects["loras_cleared"] = self._reload(now.weights, target.weights)
            actions.append("reloaded " + ", ".join(reloaded))
        self._adapters(target, actions)
        if target.released and not self.offload.released:
            effects["bytes_moved"] = self.offload.release(modules_of(self.pipe.components))
            actions.append("released")
        reached = self.state()
        if reached != target:  # a bug, not a bad request: never answer "done" for it
            raise RequestError(INTERNAL, f"applied {actions} but hold {reached}, not {target}")
        return effects

    # ------------------------------------------------------------ weights

    def _reload(self, now: dict[str, WeightSource], target: dict[str, WeightSource]) -> list[str]:
        """Load every changed module first, then swap them all in (nothing swaps on failure)."""
        changed = self._to_load(now, target)
        by_path: dict[Path, list[str]] = {}
        for name in sorted(changed):
            source = target.get(name)
            # The boot folder was given at start-up; any other is checked here.
            path = self.allowed.folder(source.path, "model_path") if source else self.boot_path
            by_path.setdefault(path, []).append(name)
        loaded: dict[str, torch.nn.Module] = {}
        for path, names in by_path.items():
            try:
                loaded |= self._load_modules(path, names)
            except RequestError:
                raise
            except Exception as exc:  # a broken checkpoint must not take the gang down
                raise bad("model_path", f"could not be loaded: {exc}") from exc
        cleared = self.loras.drop_all()
        for name, module in loaded.items():
            setattr(self.pipe, name, module)
            self.pipe.register_modules(**{name: module})
            if self.relay is not None and name in self.relay.names:
                self.relay.attach(module, name)
        self.weights = dict(target)
        return cleared

    def _to_load(self, now: dict[str, WeightSource], target: dict[str, WeightSource]) -> set[str]:
        """The changed modules, less a second denoiser this model lacks that comes from
        the first's source (an update that named no modules asks for every denoiser)."""
        held = modules_of(self.pipe.components)
        first = target.get(DENOISERS[0])
        return {
            name
            for name in _changed(now, target)
            if name in held or name not in DENOISERS[1:] or target.get(name) != first
        }

    def _load_modules(self, path: Path, names: list[str]) -> dict[str, torch.nn.Module]:
        current = modules_of(self.pipe.components)
        unknown = [n for n in names if n not in current]
        if unknown:
            raise bad("modules", f"names unknown modules: {', '.join(unknown)}")
        loaded = {}
        for name in names:
            if not (path / name).is_dir():
                raise bad("model_path", f"has no {name!r} subfolder")
            if relayed(current[name]):
                continue  # the output rank holds (and reloads) this encoder
            refuse_pickles(path / name, "model_path")
            cls: Any = type(current[name])
            dtype = next(current[name].parameters()).dtype
            module = None
            if name in DENOISERS:
                # A tp rank reads only its pieces, prepared; otherwise the module loads
                # whole and is cut here, before it moves to the device.
                module = self.parallel.read_transformer(path / name, cls, dtype)
            if module is None:
                module = cls.from_pretrained(
                    path, subfolder=name, dtype=dtype, local_files_only=True, use_safetensors=True
                )
                if name in DENOISERS:
                    self.parallel.prepare(module)
            loaded[name] = own_storage(module.to(self.device)).eval()
        return loaded

    # ------------------------------------------------------------ LoRA

    def _adapters(self, target: ControlState, actions: list[str]) -> None:
        loras = self.loras
        same = (
            loras.loaded == target.loras
            and loras.active == target.active
            and loras.merged_strength == target.merged
        )
        if same:
            return
        if loras.merged_strength is not None:
            loras.unmerge()
            actions.append("unmerged")
        for nick in sorted(set(loras.loaded) - set(target.loras)):
            loras.unload(nick)
            actions.append(f"unloaded {nick}")
        reloaded = False
        for nick, path in target.loras.items():
            if loras.loaded.get(nick) != path:
                self._load_lora(nick, path)
                actions.append(f"loaded {nick}")
                reloaded = True
        # peft activates what it loads: the active set is set again after any load.
        if target.active and (loras.active != target.active or reloaded):
            loras.activate(target.active)
            actions.append("activated " + ", ".join(f"{n}={s:g}" for n, s in target.active.items()))
        if target.merged is not None:
            loras.merge(target.merged)
            actions.append(f"merged at {target.merged:g}")

    def _load_lora(self, nick: str, path: str) -> None:
        folder = self.allowed.folder(path, "lora_path")
        refuse_pickles(folder, "lora_path")
        try:
            self.loras.load(nick, path, folder)
        except Exception as exc:
            raise bad("lora_path", f"could not be loaded as a LoRA: {exc}") from exc


def _changed(now: dict[str, WeightSource], target: dict[str, WeightSource]) -> set[str]:
    return {m for m in set(now) | set(target) if now.get(m) != target.get(m)}


def _resident(state: ControlState) -> ControlState:
    return msgspec.structs.replace(state, released=False)
