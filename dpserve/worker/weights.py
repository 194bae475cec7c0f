"""Weights as a whole: checksums, releasing them off the device and bringing them back."""

from __future__ import annotations

import hashlib
import resource
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dpserve.worker.lora_cache import INTERNAL_PREFIX


def modules_of(components: Mapping[str, object]) -> dict[str, torch.nn.Module]:
    return {name: m for name, m in components.items() if isinstance(m, torch.nn.Module)}


def _tensors(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    # Tied parameters appear once (named_parameters dedups); buffers include the
    # non-persistent ones, which a state_dict would lose.
    yield from module.named_parameters()
    yield from module.named_buffers()


def tensor_bytes(module: torch.nn.Module) -> int:
    """Bytes of every tensor of ``module`` (tied parameters once; 0 while released)."""
    return sum(t.numel() * t.element_size() for _, t in _tensors(module))


def checksum(module: torch.nn.Module) -> str:
    """sha256 over every tensor's name, dtype, shape and bytes, in name order.

    peft leaves its wrapper behind when an adapter is deleted (``x.base_layer.weight``
    for ``x.weight``): names are taken without it, so a layer that held an adapter
    and one that never did compare equal when their tensors are. The adapters requests
    loaded (worker/lora_cache.py) are left out: which ones a replica holds is its cache's
    business, not its weights'.
    """
    digest = hashlib.sha256()
    request = f".{INTERNAL_PREFIX}"
    named = (
        (name.replace(".base_layer.", "."), t)
        for name, t in _tensors(module)
        if request not in name
    )
    for name, tensor in sorted(named, key=lambda kv: kv[0]):
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(data.numpy().tobytes())
    return digest.hexdigest()


def own_storage(module: torch.nn.Module) -> torch.nn.Module:
    """Give every tensor of ``module`` its own storage from torch's allocator.

    Tensors mapped from a safetensors file sit at arbitrary offsets, and CPU
    kernels take bitwise-different paths for unaligned data: without this, a
    replica's images would change after its weights were released and resumed,
    or reloaded. (CUDA allocations are always aligned; there it is a no-op.)
    """
    for _, param in module.named_parameters():
        if param.device.type == "cpu":
            param.data = param.data.clone()
    for name, buf in list(module.named_buffers()):
        if buf.device.type == "cpu":
            _set_buffer(module, name, buf.clone())
    return module


def _set_buffer(module: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    owner_name, _, leaf = name.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    owner._buffers[leaf] = value


class WeightOffload:
    """Moves every tensor of the pipeline's modules off the device and back.

    On CUDA the tensors go to host memory; on CPU they are spilled to a
    safetensors file, since "off the device" must free the process's memory there.
    The modules keep their structure (hooks, LoRA layers), only their storage goes.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._host: dict[str, torch.Tensor] = {}
        self._spill: Path | None = None

    @property
    def released(self) -> bool:
        return bool(self._host) or self._spill is not None

    def release(self, modules: Mapping[str, torch.nn.Module]) -> int:
        """Release every tensor; returns the bytes moved."""
        saved: dict[str, torch.Tensor] = {}
        for mname, module in modules.items():
            for name, tensor in list(_tensors(module)):
                saved[f"{mname}/{name}"] = tensor.detach().to("cpu").contiguous()
        if self.device.type == "cpu":
            self._spill = Path(tempfile.mkdtemp(prefix="dpserve-spill-"))
            save_file(saved, str(self._spill / "weights.safetensors"))
            moved = sum(t.numel() * t.element_size() for t in saved.values())
            saved.clear()
        else:
            self._host = saved
            moved = sum(t.numel() * t.element_size() for t in saved.values())
        for module in modules.values():
            self._empty(module)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return moved

    def resume(self, modules: Mapping[str, torch.nn.Module]) -> None:
        if self._spill is not None:
            saved = load_file(str(self._spill / "weights.safetensors"))
        else:
            saved = self._host
        for mname, module in modules.items():
            params = dict(module.named_parameters())
            buffers = dict(module.named_buffers())
            prefix = f"{mname}/"
            for key, value in saved.items():
                if not key.startswith(prefix):
                    continue
                name = key[len(prefix) :]
                # A copy, never a view of the loaded file (see own_storage).
                if name in params:
                    params[name].data = value.to(self.device, copy=True)
                elif name in buffers:
                    _set_buffer(module, name, value.to(self.device, copy=True))
        self._host = {}
        if self._spill is not None:
            shutil.rmtree(self._spill, ignore_errors=True)
            self._spill = None

    @staticmethod
    def _empty(module: torch.nn.Module) -> None:
        for _, param in module.named_parameters():
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        for name, buf in list(module.named_buffers()):
            _set_buffer(module, name, torch.empty(0, dtype=buf.dtype, device=buf.device))


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_mb(device: torch.device) -> float:
    """CUDA: peak allocated since the request began; CPU: the process's peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
