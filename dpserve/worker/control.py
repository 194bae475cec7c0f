"""Control operations on one replica: weights, LoRA adapters, memory, introspection.

Every op runs on every rank of the gang with the same arguments, so the ranks'
replicated state (weights, adapters, released or not) never diverges; the
executor gathers the per-rank outcomes and the driver answers once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from dpserve.protocol import (
    CONFLICT,
    INVALID_REQUEST,
    MUTATING_OPS,
    UNAVAILABLE,
    UNSUPPORTED,
    ControlRequest,
    FieldError,
    RequestError,
)
from dpserve.worker.lora import LoraAdapters
from dpserve.worker.parallel import ModelParallel
from dpserve.worker.parallel.encoders import EncoderRelay, relayed
from dpserve.worker.pipeline import Pipeline
from dpserve.worker.weights import (
    WeightOffload,
    checksum,
    modules_of,
    own_storage,
    tensor_bytes,
)

log = logging.getLogger(__name__)

Agree = Callable[[bool], bool]  # True on every rank only if every rank passed True
_LORA_TARGETS = ("all", "transformer")


def _bad(field_name: str, message: str, code: str = INVALID_REQUEST) -> RequestError:
    return RequestError(code, f"{field_name} {message}", [FieldError(field_name, message)])


def _text(args: Mapping[str, Any], name: str) -> str | None:
    value = args.get(name)
    if value is not None and not isinstance(value, str):
        raise _bad(name, "must be a string")
    return value


def _number(args: Mapping[str, Any], name: str, default: float) -> float:
    value = args.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _bad(name, "must be a number")
    return float(value)


def _names(value: Any, field_name: str) -> list[str]:
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise _bad(field_name, "must be a string or a non-empty list of strings")
    return names


class ControlOps:
    def __init__(
        self,
        pipe: Pipeline,
        model_path: Path,
        device: torch.device,
        info: dict[str, Any],
        parallel: ModelParallel,
        relay: EncoderRelay | None = None,
    ) -> None:
        self.pipe = pipe
        self.model_path = model_path
        self.parallel = parallel
        self.relay = relay
        self.loras = LoraAdapters(pipe, parallel)
        self.device = device
        self.offload = WeightOffload(device)
        self.info = info  # static facts for model_info (layout, threads, ...)
        self.applied_log = 0  # last control-log position applied (see protocol.ControlRequest)

    @property
    def released(self) -> bool:
        return self.offload.released

    def require_weights(self) -> None:
        if self.released:
            raise RequestError(
                UNAVAILABLE,
                "weights are released from the device; call resume_memory_occupation first",
            )

    def run(self, request: ControlRequest, agree: Agree) -> dict[str, Any]:
        """Run one op; logged ops run in log order, once each (replays are no-ops)."""
        position = request.log_position if request.op in MUTATING_OPS else None
        if position is not None and position <= self.applied_log:
            return {"already_applied": True, "log_position": position}
        if position is not None and position != self.applied_log + 1:
            raise RequestError(
                CONFLICT,
                f"control log position {position} arrived before {self.applied_log + 1}; "
                "replay the log in order",
            )
        handler: Callable[[Mapping[str, Any], Agree], dict[str, Any]] = getattr(
            self, f"op_{request.op}"
        )
        result = handler(request.args, agree)
        if position is not None:
            self.applied_log = position
        return result

    # ------------------------------------------------------------ introspection

    def op_model_info(self, args: Mapping[str, Any], agree: Agree) -> dict[str, Any]:
        info = self.parallel.info
        return {
            **self.info,
            "model_path": str(self.model_path),
            "pipeline_class": type(self.pipe).__name__,
            "components": sorted(modules_of(self.pipe.components)),
            "released": self.released,
            "loras": sorted(self.loras.loaded),
            # Merged over the gang into one entry per rank (executor).
            "rank_weights": {
                "rank": info.local_rank,
                "tp_rank": info.tp_rank,
                "sp_rank": info.sp_rank,
                "cfg_rank": info.cfg_rank,
                "bytes": {n: tensor_bytes(m) for n, m in modules_of(self.pipe.components).items()},
            },
        }

    def op_get_weights_checksum(self, args: Mapping[str, Any], agree: Agree) -> dict[str, Any]:
        self.require_weights()
        modules = modules_of(self.pipe.components)
        wanted = _names(args.get("modules", sorted(modules)), "modules")
        missing = [m for m in wanted if m not in modules]
        if missing:
            raise _bad("modules", f"names unknown modules: {', '.join(missing)}")
        held = [name for name in wanted if not relayed(modules[name])]
        return {
            "checksums": {name: checksum(modules[name]) for name in held},
            "tp_rank": self.parallel.info.tp_rank,
            "sharded": ["transformer"] if self.parallel.sharded else [],
        }

    def op_list_loras(self, args: Mapping[str, Any], agree: Agree) -> dict[str, Any]:
        return {
            "loaded": [{"nickname": n, "path": p} for n, p in sorted(self.loras.loaded.items())],
            "active": [{"nickname": n, "strength": s} for n, s in self.loras.active.items()],
            "merged": self.loras.merged,
        }

    # ------------------------------------------------------------ weights

    def op_update_weights_from_disk(self, args: Mapping[str, Any], agree: Agree) -> dict[str, Any]:
        """Load the named modules (default: the transformer) from a folder, all or nothing.

        Every rank loads first; the new modules replace the old only if every rank
        loaded them, so a bad path leaves the old weights serving everywhere.
        """
        path_arg = _text(args, "model_path")
        names = _names(args.get("modules", ["transformer"]), "modules")
        error: RequestError | None = None
        loaded: dict[str, torch.nn.Module] = {}
        try:
            self.require_weights()
            if not path_arg:
                raise _bad("model_path", "is required")
            loaded = self._load_modules(Path(path_arg), names)
        except RequestError as exc:
            error = exc
        except Exception as exc:  # a broken checkpoint must not take the gang down
            error = _bad("model_path", f"could not be loaded: {exc}")
        if not agree(error is None):
            raise error or RequestError(
                INVALID_REQUEST, "another rank of this replica failed to load the weights"
            )
        assert path_arg is not None  # every rank loaded it
        cleared = self.loras.drop_all()
        for name, module in loaded.items():
            setattr(self.pipe, name, module)
            self.pipe.register_modules(**{name: module})
            if self.relay is not None and name in self.relay.names:
                self.relay.attach(module)
        self.model_path = Path(path_arg)
        return {"model_path": path_arg, "modules": names, "loras_cleared": cleared}

    def _load_modules(self, path: Path, names: list[str]) -> dict[str, torch.nn.Module]:
        if not path.is_dir():
            raise _bad("model_path", f"{str(path)!r} is not a folder")
        current = modules_of(self.pipe.components)
        unknown = [n for n in names if n not in current]
        if unknown:
            raise _bad("modules", f"names unknown modules: {', '.join(unknown)}")
        loaded = {}
        for name in names:
            if not (path / name).is_dir():
                raise _bad("model_path", f"has no {name!r} subfolder")
            if relayed(current[name]):
                continue  # the output rank holds (and reloads) this encoder
            cls: Any = type(current[name])
            dtype = next(current[name].parameters()).dtype
            module = cls.from_pretrained(path, subfolder=name, dtype=dtype, local_files_only=True)
            if name == "transformer":
                self.parallel.prepare(module)  # this rank's piece, before it moves to the device
            loaded[name] = own_storage(module.to(self.device)).eval()
        return loaded

    # ------------------------------------------------------------ LoRA

    def _check_target(self, args: Mapping[str, Any]) -> None:
        target = args.get("target", "all")
        if target not in _LORA_TARGETS:
            raise _bad("target", f"must be one of {', '.join(_LORA_TARGETS)}, got {target!r}")

    def op_set_lora(self, args: Mapping[str, Any], agree: Agree) -> dict[str, Any]:
        """Load adapters (when a path is given) and make exactly these ones active."""
        self.require_weights()
        self._check_target(args)
        if not hasattr(self.pipe, "load_lora_weights"):
            raise RequestError(UNSUPPORTED, f"{type(self.pipe).__name__} does not support LoRA")
        nicknames = _names(args.get("lora_nickname"), "lora_nickname")
        paths = args.get("lora_path")
        path_list = [None] * len(nicknames) if paths is None else _names(paths, "lora_path")
        strengths = args.get("strength", 1.0)
        strength_list = strengths if isinstance(strengths, list) else [strengths] * len(nicknames)
        if len(path_list) != len(nicknames):
            raise _bad("lora_path", "needs one path per nickname")
        if len(strength_list) != len(nicknames) or not all(
            isinstance(s, int | float) and not isinstance(s, bool) for s in strength_list
        ):
            raise _bad("strength", "must be a number, or a list with one number per nickname")
        if self.loras.merged:
            raise _bad("lora_nickname", "cannot change adapters while merged; unmerge first")
        for nick, path in zip(nicknames, path_list, strict=True):
            if path is None and nick not in self.loras.loaded:
                raise _bad("lora_path", f"is required: adapter {nick!r} is not loaded yet")
            if path is not None and self.loras.loaded.get(nick) != path:
                self._load_lora(nick, path)
        self.loras.activate({n: float(s) for n, s in zip(nicknames, strength_list, strict=True)})
        return {"active": [{"nickname": n, "strength": s} for n, s in self.loras.active.items()]}

    def _load_lora(self, nick: str, path: str) -> None:
        if not Path(path).exists():
            raise _bad("lora_path", f"{path!r} does not exist")
        try:
            self.loras.load(nick, path)
        except Exception as exc:
            raise _bad("lora_path", f"could not be loaded as a LoRA: {exc}") from exc

    def op_merge_lora_weights(self, args: Mapping[str, Any], agree: Agree) -> dict[str, Any]:
        self.require_weights()
        self._check_target(args)
        if not self.loras.active:
            raise _bad("lora_nickname", "no active adapter to merge; call set_lora first")
        if self.loras.merged:
            raise _bad("lora_nickname", "adapters are already merged")
        strength = _number(args, "strength", 1.0)
        self.loras.merge(strength)
        return {"merged": list(self.loras.active), "strength": strength}

    def op_unmerge_lora_weights(self, args: Mapping[str, Any], agree: Agree) -> dict[str, Any]:
        self.require_weights()
        self._check_target(args)
        if not self.loras.merged:
            raise _bad("lora_nickname", "no merged adapters to unmerge")
        self.loras.unmerge()
        return {"unmerged": list(self.loras.active)}

    def op_noop(self, args: Mapping[str, Any], agree: Agree) -> dict[str, Any]:
        return {}

    # ------------------------------------------------------------ memory

    def op_release_memory_occupation(self, args: Mapping[str, Any], agree: Agree) -> dict[str, Any]:
        if self.released:
            return {"released": True, "changed": False}
        moved = self.offload.release(modules_of(self.pipe.components))
        return {"released": True, "changed": True, "bytes_moved": moved}

    def op_resume_memory_occupation(self, args: Mapping[str, Any], agree: Agree) -> dict[str, Any]:
        if not self.released:
            return {"released": False, "changed": False}
        self.offload.resume(modules_of(self.pipe.components))
        return {"released": False, "changed": True}
