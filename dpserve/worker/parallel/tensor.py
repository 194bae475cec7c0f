"""Tensor parallel over plain local shards of ``nn.Linear`` weights.

A plan names linear layers by path and how each is split across the tp ranks:

- ``column``: output features split; each rank computes its slice (no exchange);
- ``row``: input features split (the input arrives already split by a column
  layer); the partial outputs are summed with an all-reduce, and only tp rank 0
  keeps the bias, so it is added once;
- ``gathered``: output features split, then all-gathered to the full output
  (for small outputs that every rank needs whole, like AdaLN modulations);
- ``norm``: an ``nn.RMSNorm`` over a column layer's whole output (Wan's q/k norm
  across all heads): its weight is cut like those columns, and its statistic, the
  mean of squares over every feature, sums each rank's part with an all-reduce.

``blocks`` says the split dimension is a concatenation of independently split
blocks (a layer whose input is ``cat([attention, mlp])``): every block is cut in
``tp`` pieces and rank t takes piece t of each.

**Decision:** shards are ordinary tensors, not ``DTensor``s, so everything that
handles weights (safetensors, checksums, release/resume, peft's LoRA layers,
which size themselves from ``in_features``/``out_features``) keeps working on
them unchanged. The exchanges are forward hooks on the module at each path; a
LoRA wraps a layer in a new module at the same path, so hooks are re-installed
after every adapter change (``install``), and the adapter's own matrices are
split like the weight they adapt (``shard_lora``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.utils.hooks import RemovableHandle

ShardKind = Literal["column", "row", "gathered", "norm"]


@dataclass(frozen=True)
class Shard:
    kind: ShardKind
    blocks: tuple[int, ...] | None = None  # packed blocks along the split dimension


def shard_indices(
    size: int, blocks: tuple[int, ...] | None, rank: int, degree: int
) -> slice | list[int]:
    """The indices of rank ``rank``'s piece of a dimension of ``size``."""
    parts = blocks or (size,)
    if sum(parts) != size:
        raise ValueError(f"packed blocks {parts} do not add up to {size}")
    bad = [p for p in parts if p % degree]
    if bad:
        raise ValueError(f"{size} features in blocks {parts} cannot be split {degree} ways")
    if len(parts) == 1:
        piece = size // degree
        return slice(rank * piece, (rank + 1) * piece)
    indices: list[int] = []
    offset = 0
    for part in parts:
        piece = part // degree
        indices.extend(range(offset + rank * piece, offset + (rank + 1) * piece))
        offset += part
    return indices


def gather_cat(tensor: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    """Every rank's ``tensor`` of ``group``, concatenated along ``dim`` in rank order."""
    tensor = tensor.contiguous()
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor, group=group)
    return torch.cat(parts, dim=dim)


def _take(tensor: torch.Tensor, dim: int, index: slice | list[int]) -> torch.Tensor:
    if isinstance(index, slice):
        picked = tensor.narrow(dim, index.start, index.stop - index.start)
    else:
        picked = tensor.index_select(dim, torch.tensor(index, device=tensor.device))
    return picked.contiguous().clone()  # a copy, so the full tensor's storage is freed


def fit(layer: torch.nn.Module) -> None:
    """Set a planned layer's sizes from its (cut) weight: a Linear's features, an
    RMSNorm's normalized shape."""
    if isinstance(layer, torch.nn.Linear):
        layer.out_features, layer.in_features = layer.weight.shape
    elif isinstance(layer, torch.nn.RMSNorm):
        layer.normalized_shape = (layer.weight.shape[0],)


@dataclass
class TensorParallel:
    plan: Mapping[str, Shard]
    group: dist.ProcessGroup
    rank: int
    degree: int
    _handles: list[RemovableHandle] = field(default_factory=list)

    # ------------------------------------------------------------ weights

    def check(self, module: torch.nn.Module) -> None:
        """Raise ValueError naming the first layer that this plan cannot split."""
        for path, spec in self.plan.items():
            layer = module.get_submodule(path)
            if spec.kind == "norm":
                if not isinstance(layer, torch.nn.RMSNorm) or layer.weight is None:
                    raise ValueError(
                        f"{path} is a {type(layer).__name__}, not an RMSNorm with weight"
                    )
                size = layer.weight.shape[0]
            elif not isinstance(layer, torch.nn.Linear):
                raise ValueError(f"{path} is a {type(layer).__name__}, not a Linear layer")
            else:
                size = layer.in_features if spec.kind == "row" else layer.out_features
            try:
                shard_indices(size, spec.blocks, 0, self.degree)
            except ValueError as exc:
                raise ValueError(f"tp={self.degree} cannot split {path}: {exc}") from None

    def shard(self, module: torch.nn.Module) -> None:
        """Replace every planned layer's weights by this rank's piece (in place)."""
        self.check(module)
        with torch.no_grad():
            for path, spec in self.plan.items():
                linear = module.get_submodule(path)
                if spec.kind == "norm":
                    assert isinstance(linear, torch.nn.RMSNorm) and linear.weight is not None
                    index = shard_indices(
                        linear.weight.shape[0], spec.blocks, self.rank, self.degree
                    )
                    linear.weight = torch.nn.Parameter(_take(linear.weight, 0, index), False)
                    fit(linear)
                    continue
                assert isinstance(linear, torch.nn.Linear)
                if spec.kind == "row":
                    index = shard_indices(linear.in_features, spec.blocks, self.rank, self.degree)
                    linear.weight = torch.nn.Parameter(_take(linear.weight, 1, index), False)
                    linear.in_features = linear.weight.shape[1]
                    if linear.bias is not None and self.rank != 0:
                        linear.bias.zero_()
                else:
                    index = shard_indices(linear.out_features, spec.blocks, self.rank, self.degree)
                    linear.weight = torch.nn.Parameter(_take(linear.weight, 0, index), False)
                    if linear.bias is not None:
                        linear.bias = torch.nn.Parameter(_take(linear.bias, 0, index), False)
                    linear.out_features = linear.weight.shape[0]

    def shard_lora(self, state_dict: Mapping[str, torch.Tensor], prefix: str) -> dict[str, Any]:
        """A LoRA state dict with the adapters of planned layers cut like their weights.

        Column layers split their output, so ``lora_B`` (out x r) loses rows; row
        layers split their input, so ``lora_A`` (r x in) loses columns and its
        partial product is summed by the layer's all-reduce with the rest.
        """
        out: dict[str, Any] = {}
        for key, tensor in state_dict.items():
            out[key] = tensor
            if not key.startswith(prefix):
                continue
            path, _, leaf = key[len(prefix) :].partition(".lora_")
            spec = self.plan.get(path)
            if spec is None:
                continue
            if spec.kind == "row" and leaf == "A.weight":
                index = shard_indices(tensor.shape[1], spec.blocks, self.rank, self.degree)
                out[key] = _take(tensor, 1, index)
            elif spec.kind != "row" and leaf in ("B.weight", "B.bias"):
                index = shard_indices(tensor.shape[0], spec.blocks, self.rank, self.degree)
                out[key] = _take(tensor, 0, index)
            elif leaf.startswith("magnitude"):
                raise ValueError(f"DoRA adapters cannot be split for tensor parallel ({key})")
        return out

    # ------------------------------------------------------------ exchanges

    def install(self, module: torch.nn.Module) -> None:
        """(Re-)attach the exchange hooks to whatever module now sits at each path."""
        self.remove()
        for path, spec in self.plan.items():
            if spec.kind == "column":
                continue
            hooks = {"row": self._all_reduce, "gathered": self._all_gather, "norm": self._norm}
            hook = hooks[spec.kind]
            self._handles.append(module.get_submodule(path).register_forward_hook(hook))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _all_reduce(self, module: Any, args: Any, output: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(output, group=self.group)
        return output

    def _all_gather(self, module: Any, args: Any, output: torch.Tensor) -> torch.Tensor:
        return gather_cat(output, self.group, dim=-1)

    def _norm(self, module: Any, args: Any, output: torch.Tensor) -> torch.Tensor:
        """The RMSNorm of the whole feature vector, from this rank's part of it: the local
        output is discarded, and the mean of squares is summed over the ranks (in float32,
        as torch's own RMSNorm computes it for half precision)."""
        x = args[0]
        wide = x.float()
        squares = wide.pow(2).sum(-1, keepdim=True)
        dist.all_reduce(squares, group=self.group)
        eps = module.eps if module.eps is not None else torch.finfo(x.dtype).eps
        normed = wide * torch.rsqrt(squares / (x.shape[-1] * self.degree) + eps)
        return (normed * module.weight).type_as(x)
