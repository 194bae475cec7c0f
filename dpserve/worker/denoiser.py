"""Per-request instrumentation of the pipeline's denoiser: progress ticks, the stop
gate, CFG-parallel, and the model-parallel wrapper (``ModelParallel.wrap``: the
sequence split under sp). ``denoiser_stack.py`` assembles them with the compiler and
the step cache, and states their order.

CFG-parallel relies on one convention of diffusers pipelines with true CFG (Flux,
Qwen-Image, ...): each step calls the denoiser twice in a row, the first call
inside ``transformer.cache_context("cond")`` and the second inside
``cache_context("uncond")``, and combines the two predictions only after the
second call. With two CFG ranks, rank 0 computes the conditional branch and rank
1 the unconditional one; at the second call they all-gather their predictions.
The rank that skipped the first call returned an empty tensor shaped like the
latents and fills it in place at the exchange, before the pipeline reads it
(reshaped first where the denoiser's output has fewer channels than its input).
Each rank therefore runs the exact single-process forward for its branch, so the
output is bit-identical to one process at the same thread count.

Other pipelines (SD3) batch the two branches instead: one denoiser call a step on
``torch.cat([latents] * 2)``, negative prompt first, split by ``chunk(2)`` after.
For their denoisers (the family trait ``batched_cfg``, ``splittable.FAMILIES``) each
CFG rank runs its half of the batch (rank 0 the first, unconditional half: every
argument whose first dimension is the batch is narrowed) and the halves are
all-gathered along the batch. A call with an odd batch (SD3's skip-layer guidance
passes the latents alone) runs whole on every rank. The samples of a batch never
meet in the denoiser, so this is the one-process result up to how the CPU's matrix
kernels block a batch of one against a batch of two
(tests/integration/test_sd3_parallel.py measures it).

The stop gate drops a generation whose client cancelled it or whose deadline
passed at its next denoising step instead of rendering it to the end. Every rank
calls the denoiser the same number of times (the rank that skips a branch still
enters the patched forward), so at a step's first call the driver, which alone
knows about cancellations and owns the deadline's clock, broadcasts one byte over
the gang's CPU group and every rank raises the same :class:`Halted` before the
call's first collective. A rank that stopped on its own would leave the others
waiting in a collective until it timed out. The gate skips the second branch of a
CFG split: there the rank that skipped the first branch would wait at the
broadcast for the other's first-branch forward instead of running its own branch
meanwhile. A gang of one rank checks and relays nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from diffusers.models.modeling_outputs import Transformer2DModelOutput

from dpserve.contract.protocol import (
    CANCELLED,
    DEADLINE_EXCEEDED,
    RequestError,
)
from dpserve.worker.splittable import BATCHED_CFG

Forward = Callable[..., Any]
# The driver's look at the running request: why it must stop now (a CANCELLED or
# DEADLINE_EXCEEDED error), or None.
HaltCheck = Callable[[], RequestError | None]
_HALT_CODES: tuple[str | None, ...] = (None, CANCELLED, DEADLINE_EXCEEDED)


class Halted(RequestError):
    """The gang dropped the request at a denoiser call; answered like any refusal."""


class StopGate:
    """Asks the driver, at a step's denoiser call, whether the request goes on; every
    rank gets the same answer (see the module's docstring).

    ``group`` is the gang's CPU group (``None`` for a gang of one rank: nothing to
    relay); ``check`` is the driver's (``None`` on the other ranks, and for work
    nobody can cancel, such as the warm-up).
    """

    def __init__(self, group: dist.ProcessGroup | None, src: int, check: HaltCheck | None) -> None:
        self.group = group
        self.src = src
        self.check = check
        self.calls = 0
        self._flag = torch.zeros(1, dtype=torch.uint8)

    def __call__(self, ask: bool = True) -> None:
        """One denoiser call; ``ask`` is False where the gate must not stop the ranks."""
        self.calls += 1
        if not ask:
            return
        error = self.check() if self.check is not None else None
        if self.group is not None:
            self._flag[0] = 0 if error is None else _HALT_CODES.index(error.code)
            dist.broadcast(self._flag, src=self.src, group=self.group)
            code = _HALT_CODES[int(self._flag[0])]
            if code is not None and error is None:  # another rank's view; never sent
                error = RequestError(code, "stopped by the driver")
        if error is not None:
            raise Halted(error.code, f"{error}; dropped at denoiser call {self.calls}")


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
                # The input carried conditioning channels the output has not (Wan
                # image-to-video: noise, mask and image latents in, noise out). The
                # pipeline holds this very tensor: reshaped in place, it sees the
                # prediction.
                cond.resize_(gathered[0].shape)
            cond.copy_(gathered[0])
        return _wrap(uncond, kwargs)


def _batch_half(value: Any, batch: int, rank: int) -> Any:
    """``value``'s half ``rank`` along a first dimension of size ``batch`` (a list or
    tuple of such tensors, each); anything else as it is."""
    if isinstance(value, torch.Tensor):
        if value.ndim == 0 or value.shape[0] != batch:
            return value
        return value.narrow(0, rank * (batch // 2), batch // 2)
    tensors = isinstance(value, list | tuple) and all(isinstance(v, torch.Tensor) for v in value)
    if tensors and value:
        return type(value)(_batch_half(v, batch, rank) for v in value)
    return value


class _BatchSplit:
    """One request's CFG split of a batched-CFG denoiser: each call, this CFG rank runs
    its half of the batch, then the halves are all-gathered (module docstring)."""

    def __init__(self, cfg_rank: int, group: dist.ProcessGroup) -> None:
        self.cfg_rank = cfg_rank
        self.group = group

    def call(self, forward: Forward, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        latents = kwargs.get("hidden_states", args[0] if args else None)
        if not isinstance(latents, torch.Tensor):
            raise RuntimeError("CFG-parallel needs the denoiser's hidden_states argument")
        batch = latents.shape[0]
        if batch % 2:
            return forward(*args, **kwargs)
        args = tuple(_batch_half(a, batch, self.cfg_rank) for a in args)
        kwargs = {k: _batch_half(v, batch, self.cfg_rank) for k, v in kwargs.items()}
        mine = _sample(forward(*args, **kwargs)).contiguous()
        gathered = [torch.empty_like(mine) for _ in range(2)]
        dist.all_gather(gathered, mine, group=self.group)
        return _wrap(torch.cat(gathered), kwargs)


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
        return self.cfg_group is not None and (
            hasattr(denoiser, "cache_context") or self.batched(denoiser)
        )

    @staticmethod
    def batched(denoiser: torch.nn.Module) -> bool:
        return type(denoiser).__name__ in BATCHED_CFG

    @contextlib.contextmanager
    def applied(
        self, denoiser: torch.nn.Module, split: bool, gate: StopGate | None = None
    ) -> Iterator[None]:
        # A CFG gang's request without true CFG lends the CFG ranks to the split.
        lend = self.cfg_group is not None and not split
        original_forward: Forward = self.wrap(denoiser.forward, lend)
        original_context = getattr(denoiser, "cache_context", None)
        state: _BranchSplit | _BatchSplit | None = None
        if split and self.cfg_group is not None:
            batched = self.batched(denoiser)
            state = (_BatchSplit if batched else _BranchSplit)(self.cfg_rank, self.cfg_group)

        def forward(*args: Any, **kwargs: Any) -> Any:
            self.on_step()
            if gate is not None:
                gate(ask=not isinstance(state, _BranchSplit) or state.branch != "uncond")
            if state is None:
                return original_forward(*args, **kwargs)
            return state.call(original_forward, args, kwargs)

        @contextlib.contextmanager
        def cache_context(name: str, **kw: Any) -> Iterator[None]:
            assert original_context is not None and isinstance(state, _BranchSplit)
            state.branch = name
            try:
                with original_context(name, **kw):
                    yield
            finally:
                state.branch = None

        # Instance attributes shadow the class's methods for this request only.
        object.__setattr__(denoiser, "forward", forward)
        if isinstance(state, _BranchSplit):
            object.__setattr__(denoiser, "cache_context", cache_context)
        try:
            yield
        finally:
            denoiser.__dict__.pop("forward", None)
            denoiser.__dict__.pop("cache_context", None)
