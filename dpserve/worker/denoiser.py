"""Per-request instrumentation of the pipeline's denoiser: progress ticks, CFG-parallel,
and the model-parallel wrapper (``ModelParallel.wrap``: the sequence split under sp).

CFG-parallel relies on one convention of diffusers pipelines with true CFG (Flux,
Qwen-Image, ...): each step calls the denoiser twice in a row, the first call
inside ``transformer.cache_context("cond")`` and the second inside
``cache_context("uncond")``, and combines the two predictions only after the
second call. With two CFG ranks, rank 0 computes the conditional branch and rank
1 the unconditional one; at the second call they all-gather their predictions.
The rank that skipped the first call returned an empty tensor shaped like the
latents and fills it in place at the exchange, before the pipeline reads it.
Each rank therefore runs the exact single-process forward for its branch, so the
output is bit-identical to one process at the same thread count.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from diffusers.models.modeling_outputs import Transformer2DModelOutput

Forward = Callable[..., Any]


def _sample(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output.sample


def _wrap(sample: torch.Tensor, kwargs: dict[str, Any]) -> Any:
    return (sample,) if not kwargs.get("return_dict", True) else Transformer2DModelOutput(sample)


class _BranchSplit:
    """State of one request's split: which branch is running and the pending cond tensor."""

    def __init__(self, cfg_rank: int, group: dist.ProcessGroup) -> None:
        self.cfg_rank = cfg_rank
        self.group = group
        self.branch: str | None = None
        self.cond: torch.Tensor | None = None

    def call(self, forward: Forward, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.branch == "cond":
            return self._cond(forward, args, kwargs)
        if self.branch == "uncond" and self.cond is not None:
            return self._uncond(forward, args, kwargs)
        return forward(*args, **kwargs)

    def _cond(self, forward: Forward, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.cfg_rank == 0:
            self.cond = _sample(forward(*args, **kwargs))
        else:
            latents = kwargs.get("hidden_states", args[0] if args else None)
            if not isinstance(latents, torch.Tensor):
                raise RuntimeError("CFG-parallel needs the denoiser's hidden_states argument")
            self.cond = torch.empty_like(latents)
        return _wrap(self.cond, kwargs)

    def _uncond(self, forward: Forward, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        cond, self.cond = self.cond, None
        assert cond is not None
        if self.cfg_rank == 1:
            uncond = _sample(forward(*args, **kwargs)).contiguous()
            mine = uncond
        else:
            mine = cond.contiguous()
            uncond = torch.empty_like(mine)
        gathered = [torch.empty_like(mine) for _ in range(2)]
        dist.all_gather(gathered, mine, group=self.group)
        if self.cfg_rank == 0:
            uncond.copy_(gathered[1])
        else:
            if cond.shape != gathered[0].shape:
                raise RuntimeError(
                    f"CFG-parallel needs the denoiser output shaped like its input "
                    f"({tuple(gathered[0].shape)} != {tuple(cond.shape)})"
                )
            cond.copy_(gathered[0])
        return _wrap(uncond, kwargs)


class DenoiserPatch:
    """Patches ``pipe.transformer`` for one request, then restores it."""

    def __init__(
        self,
        cfg_rank: int,
        cfg_group: dist.ProcessGroup | None,
        on_step: Callable[[], None],
        wrap: Callable[[Forward, bool], Forward] = lambda forward, lend: forward,
    ) -> None:
        self.cfg_rank = cfg_rank
        self.cfg_group = cfg_group
        self.on_step = on_step
        self.wrap = wrap

    def can_split(self, denoiser: torch.nn.Module) -> bool:
        return self.cfg_group is not None and hasattr(denoiser, "cache_context")

    @contextlib.contextmanager
    def applied(self, denoiser: torch.nn.Module, split: bool) -> Iterator[None]:
        # A CFG gang's request without true CFG lends the CFG ranks to the split.
        lend = self.cfg_group is not None and not split
        original_forward: Forward = self.wrap(denoiser.forward, lend)
        original_context = getattr(denoiser, "cache_context", None)
        state = (
            _BranchSplit(self.cfg_rank, self.cfg_group)
            if split and self.cfg_group is not None
            else None
        )

        def forward(*args: Any, **kwargs: Any) -> Any:
            self.on_step()
            if state is None:
                return original_forward(*args, **kwargs)
            return state.call(original_forward, args, kwargs)

        @contextlib.contextmanager
        def cache_context(name: str, **kw: Any) -> Iterator[None]:
            assert original_context is not None and state is not None
            state.branch = name
            try:
                with original_context(name, **kw):
                    yield
            finally:
                state.branch = None

        # Instance attributes shadow the class's methods for this request only.
        object.__setattr__(denoiser, "forward", forward)
        if state is not None:
            object.__setattr__(denoiser, "cache_context", cache_context)
        try:
            yield
        finally:
            denoiser.__dict__.pop("forward", None)
            denoiser.__dict__.pop("cache_context", None)
