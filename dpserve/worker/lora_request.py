"""A request's own LoRA adapters (docs/lora.md): resident, active for its call only.

``applied`` wraps one pipeline call. Before it, every adapter the request names is
made resident (loaded from its folder into the transformer under an internal name,
worker/lora_cache.py) and exactly the request's adapters are made active with their
scales: the request's set *replaces* the service's active set. After it, whatever
happened, the service's active set is back. The ranks of a gang load together and
agree, as control ops do: if any rank failed, every rank drops what it loaded for
the request and the request fails with the failing rank's reason.

peft's traps, and why the code looks the way it does: peft makes what it loads
active (so the active set is always put back after a load); ``pipe.set_adapters([])``
raises, and ``disable_lora`` leaves a flag behind, so "nothing active" is said to each
peft layer (``set_adapter([])``); deleting an active adapter makes peft pick another.
"""

from __future__ import annotations

import inspect
import os
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from peft.tuners.tuners_utils import BaseTunerLayer

from dpserve.contract.control_state import bad
from dpserve.contract.protocol import CONFLICT, LoraRef, RequestError
from dpserve.worker.lora import LoraAdapters
from dpserve.worker.lora_cache import AdapterCache, folder_bytes, internal_name
from dpserve.worker.parallel import ModelParallel
from dpserve.worker.paths import AllowedPaths, refuse_pickles
from dpserve.worker.pipeline import Pipeline
from dpserve.worker.weights import modules_of

FIELD = "lora"
# This rank's refusal (None: it had none) in; the first rank's refusal, on every rank, out.
Agree = Callable[[RequestError | None], RequestError | None]


@dataclass
class _Fresh:
    """An adapter loaded for this request, kept only if every rank loaded its own."""

    name: str
    path: str
    size: int
    seconds: float


@dataclass
class RequestAdapters:
    pipe: Pipeline
    parallel: ModelParallel
    service: LoraAdapters  # the control state's adapters (the pinned ones)
    allowed: AllowedPaths
    cache: AdapterCache

    @contextmanager
    def applied(self, refs: Sequence[LoraRef] | None, agree: Agree) -> Iterator[None]:
        """The request's adapters for the duration of the block; None: the service's."""
        if refs is None:
            yield
            return
        fresh: list[_Fresh] = []
        mine: RequestError | None = None
        active: dict[str, float] | None = None
        try:
            active = self._prepare(refs, fresh)
        except RequestError as exc:
            mine = exc
        except Exception as exc:  # a broken file must not take the gang down
            mine = bad(FIELD, f"could not be applied: {exc}")
        refused = agree(mine)
        if refused is not None:
            self._drop(fresh)
            self.cache.failures += 1
            self.restore()
            raise refused
        for item in fresh:
            self.cache.loaded(item.name, item.path, item.size, item.seconds)
        try:
            if active is not None:  # None: merged, and asking for exactly the merged set
                self._evict(in_use={r.name for r in refs})
                self._activate(active)
            yield
        finally:
            self.restore()

    def restore(self) -> None:
        """The service's active set, and no request adapter, active again."""
        service = self.service
        if service.merged:
            return  # never changed while merged (a request may only ask for what is)
        if service.active:
            service.activate(service.active)
        else:
            self._deactivate_all()

    def reconcile(self) -> None:
        """After a control op: a weight reload drops every adapter (request ones too),
        and peft activates a leftover adapter when an active one is deleted."""
        held = set(getattr(self._transformer(), "peft_config", {}) or {})
        self.cache.forget(n for n in self.cache.entries if internal_name(n) not in held)
        self.restore()

    # ------------------------------------------------------------ before the call

    def _prepare(self, refs: Sequence[LoraRef], fresh: list[_Fresh]) -> dict[str, float] | None:
        service = self.service
        if service.merged:
            self._check_merged(refs)
            return None
        if refs and not hasattr(self.pipe, "load_lora_into_transformer"):
            raise bad(
                FIELD,
                f"{type(self.pipe).__name__} takes adapters for the whole service only "
                "(set_lora): a request's own adapters adapt a transformer, which it has not",
            )
        active: dict[str, float] = {}
        for ref in refs:
            if ref.name in service.loaded:  # the service's own adapter, by its nickname
                self._same_path(ref, service.loaded[ref.name])
                active[ref.name] = ref.scale
                continue
            bound = self.cache.known.get(ref.name)
            if bound is not None:
                self._same_path(ref, bound)
            path = bound if bound is not None else ref.path
            if path is None:
                raise bad(
                    FIELD,
                    f"adapter {ref.name!r} is unknown to this replica: give its path "
                    "(or have it registered)",
                )
            if not self.cache.touch(ref.name):
                fresh.append(self._load(ref.name, path))
            active[internal_name(ref.name)] = ref.scale
        return active

    def _check_merged(self, refs: Sequence[LoraRef]) -> None:
        """While merged only the merged set itself may be asked for (nothing changes)."""
        service = self.service
        asked = {r.name: r.scale for r in refs}
        if asked == service.active and all(
            r.path is None or _same(r.path, service.loaded[r.name]) for r in refs
        ):
            return
        raise bad(
            FIELD,
            "cannot be applied for one request while the service's adapters are merged "
            "into the weights (merge_lora_weights): call unmerge_lora_weights first",
            CONFLICT,
        )

    def _same_path(self, ref: LoraRef, bound: str) -> None:
        if ref.path is not None and not _same(ref.path, bound):
            raise bad(
                FIELD,
                f"adapter {ref.name!r} is bound to {bound}, not {ref.path}: "
                "use a new name for another adapter",
            )

    def _load(self, name: str, path: str) -> _Fresh:
        try:
            folder = self.allowed.folder(path, FIELD)
            refuse_pickles(folder, FIELD)
        except RequestError as exc:  # the same words, naming the adapter
            raise bad(FIELD, f"adapter {name!r}: its path {exc.fields[0].message}") from None
        size = folder_bytes(folder)
        if not self.cache.fits(size):
            raise bad(
                FIELD,
                f"adapter {name!r} takes {size} bytes, more than this replica's whole "
                f"adapter cache ({self.cache.capacity} bytes, --lora-cache-mb)",
            )
        started = time.perf_counter()
        try:
            self._load_into_transformer(name, folder)
        except RequestError:
            self._delete(internal_name(name))
            raise
        except Exception as exc:
            self._delete(internal_name(name))
            raise bad(FIELD, f"adapter {name!r} could not be loaded as a LoRA: {exc}") from exc
        return _Fresh(name, path, size, time.perf_counter() - started)

    def _load_into_transformer(self, name: str, folder: Path) -> None:
        """diffusers' transformer loading step alone, with the adapter cut to this rank's
        layers (as ``set_lora``'s are); adapters that would touch anything else are refused."""
        pipe: Any = self.pipe
        read = inspect.signature(pipe.lora_state_dict).parameters
        alphas = None
        if "return_alphas" in read:  # Flux's form
            state, alphas, metadata = pipe.lora_state_dict(
                str(folder), return_alphas=True, return_lora_metadata=True, use_safetensors=True
            )
        else:
            state, metadata = pipe.lora_state_dict(
                str(folder), return_lora_metadata=True, use_safetensors=True
            )
        transformer = self._transformer()
        prefix = f"{getattr(pipe, 'transformer_name', 'transformer')}."
        # Keys first, on the whole adapter; shapes on this rank's cut of it (a tp rank's
        # layers are cut too).
        problem = foreign_keys(state, prefix)
        if problem is None:
            state = self.parallel.shard_lora(transformer, state, prefix)
            problem = misfit(state, transformer, prefix)
        if problem is not None:
            raise bad(FIELD, f"adapter {name!r} {problem}")
        extra: dict[str, Any] = {"metadata": metadata, "_pipeline": pipe}
        if "network_alphas" in inspect.signature(pipe.load_lora_into_transformer).parameters:
            extra["network_alphas"] = alphas
        with warnings.catch_warnings():
            # peft warns on every adapter after the first that the model holds several:
            # what a cache is for.
            warnings.filterwarnings("ignore", message="Already found a `peft_config`")
            pipe.load_lora_into_transformer(
                state, transformer=transformer, adapter_name=internal_name(name), **extra
            )
        self.parallel.adapters_changed(transformer)

    # ------------------------------------------------------------ around the call

    def _activate(self, active: dict[str, float]) -> None:
        if active:
            self.pipe.set_adapters(list(active), adapter_weights=list(active.values()))
        else:
            self._deactivate_all()

    def _deactivate_all(self) -> None:
        for module in modules_of(self.pipe.components).values():
            for layer in module.modules():
                if isinstance(layer, BaseTunerLayer):
                    layer.set_adapter([])

    def _evict(self, in_use: set[str]) -> None:
        for name in self.cache.victims(in_use):
            started = time.perf_counter()
            self._delete(internal_name(name))
            self.cache.evicted(name, time.perf_counter() - started)

    def _drop(self, fresh: Sequence[_Fresh]) -> None:
        for item in fresh:
            self._delete(internal_name(item.name))

    def _delete(self, internal: str) -> None:
        transformer = self._transformer()
        if internal in (getattr(transformer, "peft_config", None) or {}):
            with warnings.catch_warnings():
                # peft activates another adapter when an active one goes: put right by
                # restore(), which every path through applied() ends with.
                warnings.filterwarnings("ignore", message="Adapter .* was active which is now")
                transformer.delete_adapters(internal)
            self.parallel.adapters_changed(transformer)

    def _transformer(self) -> Any:
        return self.pipe.transformer


def _same(a: str, b: str) -> bool:
    return a == b or os.path.realpath(a) == os.path.realpath(b)


def foreign_keys(state: Mapping[str, torch.Tensor], prefix: str) -> str | None:
    """Why an adapter is no request adapter: keys outside the transformer (text
    encoders), or keys that replace its own weights (Flux's control and norm adapters,
    which diffusers loads into the base model). None: LoRA pairs of the transformer."""
    outside = sorted({k.split(".")[0] for k in state if not k.startswith(prefix)})
    if outside:
        return f"adapts {', '.join(outside)}: a request's adapters adapt the transformer only"
    own = sorted(k[len(prefix) :] for k in state if ".lora" not in k)
    if own:
        return (
            f"changes the transformer's own weights ({own[0]}"
            + (f" and {len(own) - 1} more" if len(own) > 1 else "")
            + "): such adapters can only be set for the whole service (set_lora)"
        )
    return None


def misfit(
    state: Mapping[str, torch.Tensor], transformer: torch.nn.Module, prefix: str
) -> str | None:
    """Why an adapter's tensors cannot be a request's adapter of ``transformer``: targets
    it lacks, or shapes that do not fit the layers they adapt. None: they fit."""
    for key, tensor in state.items():
        path, _, leaf = key[len(prefix) :].partition(".lora_")
        try:
            layer = transformer.get_submodule(path)
        except AttributeError:
            return f"targets {path}, which this model's transformer does not have"
        if isinstance(layer, BaseTunerLayer):
            layer = layer.get_base_layer()
        if not isinstance(layer, torch.nn.Linear) or tensor.dim() != 2:
            continue  # peft says what is wrong, if anything
        if leaf.startswith("A.") and tensor.shape[1] != layer.in_features:
            return _shape(path, "input", tensor.shape[1], layer.in_features)
        if leaf.startswith("B.") and tensor.shape[0] != layer.out_features:
            return _shape(path, "output", tensor.shape[0], layer.out_features)
    return None


def _shape(path: str, side: str, got: int, wanted: int) -> str:
    return (
        f"does not fit this model: its {path} adapter has {got} {side} features, "
        f"the layer has {wanted}"
    )
