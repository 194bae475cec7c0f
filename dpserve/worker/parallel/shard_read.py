"""A tensor-parallel rank's transformer read from its checkpoint, only its own pieces.

The module is built without weights (on the meta device, from its config, as
diffusers' own loader does), the plan's layers are given their shard shapes, and
every tensor is then read from the component's safetensors file(s) with slice
reads (``safe_open(...).get_slice(name)[...]`` copies only the bytes asked for):
a planned layer only this rank's rows or columns (``shard_indices``, blocks
included; a ``norm`` layer's weight like a column layer's), everything else
whole. So a rank never holds a whole planned weight, and its host peak is about
its share of the transformer, not all of it.

**Decision:** the checkpoint's keys and shapes must be exactly the module's. When
they are not (a checkpoint diffusers would convert on load), ``CannotRead`` says
why and the caller loads the whole module as before: never a guessed mapping.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate import init_empty_weights
from safetensors import safe_open

from dpserve.worker.parallel.tensor import Shard, TensorParallel, fit, shard_indices

WEIGHTS = "diffusion_pytorch_model.safetensors"
INDEX = WEIGHTS + ".index.json"
MAPPED_BYTES = 64 << 20  # of a file's tensors read through one mapping (see read_pieces)


class CannotRead(Exception):
    """The checkpoint cannot be read piecewise into this module (the message says why)."""


@dataclass
class ReadReport:
    """What one rank read: elements per checkpoint key, and the whole checkpoint's;
    ``split``: the keys of the tensors cut across the ranks (a row layer's bias is
    not: rank 0 holds it whole, the others zeros)."""

    elements: dict[str, int] = field(default_factory=dict)
    whole: dict[str, int] = field(default_factory=dict)
    split: set[str] = field(default_factory=set)

    @property
    def share(self) -> float:
        """The share of the checkpoint's elements this rank read."""
        return sum(self.elements.values()) / max(1, sum(self.whole.values()))

    def largest(self, keys: set[str] | None = None) -> float:
        """The largest share of any one tensor (of ``keys``, default all) read."""
        return max(self.elements[k] / max(1, self.whole[k]) for k in keys or self.whole)


def checkpoint_files(folder: Path) -> dict[str, Path]:
    """Each key of a component's safetensors checkpoint and the file that holds it."""
    index = folder / INDEX
    if index.is_file():
        weight_map: Mapping[str, str] = json.loads(index.read_text())["weight_map"]
        return {key: folder / name for key, name in weight_map.items()}
    single = folder / WEIGHTS
    if not single.is_file():
        raise CannotRead(f"{folder} has neither {WEIGHTS} nor {INDEX}")
    with safe_open(single, "pt", device="cpu") as f:
        return dict.fromkeys(f.keys(), single)


def empty_module(cls: Any, folder: Path) -> torch.nn.Module:
    """``cls`` built from ``folder``'s config with its parameters on the meta device."""
    with init_empty_weights():
        module: torch.nn.Module = cls.from_config(cls.load_config(folder))
    return module


def read_pieces(
    module: torch.nn.Module, folder: Path, dtype: torch.dtype, tensor: TensorParallel
) -> ReadReport:
    """Fill ``module`` (from :func:`empty_module`) with this rank's pieces, in ``dtype``.

    Raises CannotRead when the checkpoint's keys (checked before any read) or shapes
    are not the module's; the module is then unusable.
    """
    expected = dict(module.state_dict(keep_vars=True))
    files = checkpoint_files(folder)
    missing, unexpected = sorted(set(expected) - set(files)), sorted(set(files) - set(expected))
    if missing or unexpected:
        raise CannotRead(
            f"its checkpoint's keys are not {type(module).__name__}'s "
            f"({len(missing)} missing, e.g. {missing[:2]}; "
            f"{len(unexpected)} unexpected, e.g. {unexpected[:2]})"
        )
    keep_fp32 = tuple(getattr(type(module), "_keep_in_fp32_modules", None) or ())
    report = ReadReport()
    by_file: dict[Path, list[str]] = {}
    for key, path in files.items():
        by_file.setdefault(path, []).append(key)
    for path, keys in sorted(by_file.items()):
        pending = list(reversed(keys))
        while pending:
            # Pages a slice read touches stay resident while the file is mapped (and a
            # column cut touches most pages of its rows): reopening it every
            # MAPPED_BYTES of tensors unmaps them, bounding the rank's peak.
            with safe_open(path, "pt", device="cpu") as f:
                mapped = 0
                while pending and mapped < MAPPED_BYTES:
                    key = pending.pop()
                    part = f.get_slice(key)
                    shape = tuple(part.get_shape())
                    if shape != tuple(expected[key].shape):
                        raise CannotRead(
                            f"{key} is {list(shape)} in the checkpoint, "
                            f"{list(expected[key].shape)} in the module"
                        )
                    owner, _, leaf = key.rpartition(".")
                    spec = tensor.plan.get(owner)
                    # A scalar cannot be sliced (nor split): read whole.
                    piece = _piece(part, shape, spec, leaf, tensor) if shape else f.get_tensor(key)
                    report.whole[key] = _count(shape)
                    report.elements[key] = 0 if piece is None else piece.numel()
                    if spec is not None and not (spec.kind == "row" and leaf == "bias"):
                        report.split.add(key)
                    if piece is None:  # a row layer's bias off rank 0: added once, there
                        piece = torch.zeros(shape, dtype=expected[key].dtype)
                    mapped += report.whole[key] * piece.element_size()
                    if piece.is_floating_point():
                        fp32 = any(name in key.split(".") for name in keep_fp32)
                        piece = piece.to(torch.float32 if fp32 else dtype)
                    _put(module, owner, leaf, piece, expected[key])
    for layer in tensor.plan:
        fit(module.get_submodule(layer))
    return report


def _piece(
    part: Any, shape: tuple[int, ...], spec: Shard | None, leaf: str, tp: TensorParallel
) -> torch.Tensor | None:
    """This rank's piece of one checkpoint tensor (None: zeros, nothing to read)."""
    if spec is None:
        return torch.as_tensor(part[:])
    if spec.kind == "row":
        if leaf == "bias":
            return torch.as_tensor(part[:]) if tp.rank == 0 else None
        dim = 1
    else:
        dim = 0
    index = shard_indices(shape[dim], spec.blocks, tp.rank, tp.degree)
    runs = [index] if isinstance(index, slice) else list(_runs(index))
    pieces = [part[:, run] if dim == 1 else part[run] for run in runs]
    return torch.as_tensor(pieces[0]) if len(pieces) == 1 else torch.cat(pieces, dim=dim)


def _runs(indices: list[int]) -> Iterator[slice]:
    """Consecutive runs of ``indices`` as slices (a blocked shard is one run per block)."""
    start = prev = indices[0]
    for i in indices[1:]:
        if i != prev + 1:
            yield slice(start, prev + 1)
            start = i
        prev = i
    yield slice(start, prev + 1)


def _put(
    module: torch.nn.Module, owner: str, leaf: str, value: torch.Tensor, old: torch.Tensor
) -> None:
    holder = module.get_submodule(owner) if owner else module
    if isinstance(old, torch.nn.Parameter):
        holder._parameters[leaf] = torch.nn.Parameter(value, old.requires_grad)
    else:
        holder._buffers[leaf] = value


def _count(shape: tuple[int, ...]) -> int:
    n = 1
    for side in shape:
        n *= side
    return n
