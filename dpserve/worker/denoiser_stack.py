"""The denoiser's layers for one pipeline call, assembled in one place and one order.

Five owners change what a call of the pipeline's denoiser does: the compiler
(``compile.py``), the step cache (``step_cache.py``), the per-request patch with its
progress tick, stop gate and CFG split (``denoiser.py``), and the sequence split
(``parallel/__init__.py``, ``ModelParallel.wrap``). They reach the same ``forward``
through two mechanisms: diffusers' hook registry (the step cache's hooks on the
denoiser's blocks, keyed by ``cache_context``) and instance attributes that shadow
the class's ``forward`` and ``cache_context`` for one request (the patch).
:class:`DenoiserStack` is the only place that puts them together.

Around the pipeline call, entered in this order and left in reverse:

1. ``torch.inference_mode``.
2. The compiler's stance (``Compiler.stance``): after warm-up a call whose shapes
   no warmed graph fits runs eager. It covers the whole call, so every compiled
   forward of it obeys.
3. The step cache (``step_cache.applied``): ``enable_cache`` registers its hooks
   in diffusers' registry on the denoiser's blocks, then the call runs in a
   ``"cond"`` cache context unless the pipeline enters its own. It is entered
   before the patch: once the patch shadows ``cache_context``, entering one marks
   a CFG branch, and the cache's call-wide context is not one.
4. The patch (``DenoiserPatch.applied``): shadows ``forward`` (and, under a CFG
   split, ``cache_context``) for this request; restored on the way out.

Each denoiser call the pipeline makes then runs, from the pipeline down to the
transformer's math:

a. The progress tick (the ping's stall detector).
b. The stop gate (``StopGate``): the driver's answer broadcast to every rank,
   before any collective below it, so every rank stops at the same call. It is
   not asked at the second branch of a CFG split (``denoiser.py`` says why).
c. The CFG split (``_BranchSplit``): which rank runs this branch, and the
   all-gather of both predictions at the second one. It sits above the sequence
   split: each CFG rank's branch is cut over that rank's own sp group.
d. The sequence split (``ModelParallel.wrap``): tokens cut over the sp ranks, and
   over the CFG ranks too when lent (a CFG gang's request without true CFG). A
   compiled or step-cached call is never lent: the split's exchanges would run
   inside the graph, and ranks holding different slices could decide differently
   whether to skip a block.
e. The compiled forward (``Compiler.compiled``: the class's ``forward`` through
   ``torch.compile``), below every exchange so that no collective is traced.
   Compile is refused with tp and sp and with step caches (``compile.refusal``).
f. The class's ``forward``, inside which the step cache's hooks run on the
   blocks, deciding per the cache context that (c) or (3) entered.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dpserve.contract.protocol import StepCache
from dpserve.worker import step_cache
from dpserve.worker.compile import Compiler
from dpserve.worker.denoiser import DenoiserPatch, Forward, StopGate

# ModelParallel.wrap: the forward for one request, lent to the CFG ranks' split or not.
SequenceWrap = Callable[[Forward, bool], Forward]


@dataclass(frozen=True)
class DenoiserStack:
    """One rank's layers around its pipeline's denoiser (see the module's docstring).

    ``cfg_rank``/``cfg_group`` are the CFG split's (``None``: no CFG split);
    ``sequence`` is ``ModelParallel.wrap`` (``None``: no model parallel);
    ``on_step`` is the progress tick.
    """

    cfg_rank: int
    cfg_group: dist.ProcessGroup | None
    on_step: Callable[[], None]
    sequence: SequenceWrap | None = None
    compiler: Compiler | None = None

    def can_split(self, denoiser: torch.nn.Module) -> bool:
        """Whether this rank can split a call's CFG branches over its CFG group."""
        return self._patch(cached=False).can_split(denoiser)

    def forward_for(self, forward: Forward, lend: bool, cached: bool) -> Forward:
        """Layers (d) and (e) over the denoiser's own ``forward``: compiled under
        --compile, then split by the layout; lent only when neither compiled nor cached."""
        if self.compiler is not None:
            forward = self.compiler.compiled(forward)
        lend = lend and self.compiler is None and not cached
        return forward if self.sequence is None else self.sequence(forward, lend)

    @contextlib.contextmanager
    def applied(
        self,
        denoiser: torch.nn.Module | Sequence[torch.nn.Module],
        split: bool,
        cache: StepCache | None,
        gate: StopGate | None = None,
    ) -> Iterator[None]:
        """Every layer around one pipeline call of ``denoiser``: ``split`` when its CFG
        branches go to the CFG ranks, ``cache`` the resolved step cache (or None),
        ``gate`` the generation's stop gate (None for a session's frame).

        A pipeline with two denoisers (Wan 2.2's experts, one called above the boundary
        timestep and the other below it) passes both: each gets its own step cache and
        patch (its own CFG branches), and they share the progress tick and the stop
        gate, so whichever the pipeline calls is split alike."""
        denoisers = [denoiser] if isinstance(denoiser, torch.nn.Module) else list(denoiser)
        stance = self.compiler.stance() if self.compiler else contextlib.nullcontext()
        patch = self._patch(cached=cache is not None)
        with contextlib.ExitStack() as layers:
            layers.enter_context(torch.inference_mode())
            layers.enter_context(stance)
            for module in denoisers:
                layers.enter_context(step_cache.applied(module, cache))
            for module in denoisers:
                layers.enter_context(patch.applied(module, split, gate))
            yield

    def _patch(self, cached: bool) -> DenoiserPatch:
        def wrap(forward: Forward, lend: bool) -> Forward:
            return self.forward_for(forward, lend, cached)

        return DenoiserPatch(self.cfg_rank, self.cfg_group, self.on_step, wrap)
