"""Sequence and tensor parallel for one gang: which model parts are split, and how.

``ModelParallel`` is the one owner of a rank's split: it checks that the model
can be split as the layout asks, shards the transformer when it is loaded (at
start-up and after a weight update), re-attaches the tensor-parallel exchanges
after an adapter change, and wraps the transformer's forward for each request
(below the CFG split and above the compiled forward: ``worker/denoiser_stack.py``).
A CFG gang also lends its CFG ranks to the sequence split of a request without
true CFG (there is no second branch to run). Outside a split call attention is
diffusers' own, so CFG-split requests stay bitwise equal to one rank; a single
rank is left untouched.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dpserve.contract.layout import ParallelConfig, RankInfo
from dpserve.worker.parallel.attention import SequenceGroups
from dpserve.worker.parallel.families import plan_of
from dpserve.worker.parallel.sequence import AttentionScope, SequenceCut, SequenceSplit
from dpserve.worker.parallel.shard_read import CannotRead, ReadReport, empty_module, read_pieces
from dpserve.worker.parallel.tensor import TensorParallel
from dpserve.worker.splittable import splittable_problem, text_tokens_problem

log = logging.getLogger(__name__)
Forward = Callable[..., Any]


class ParallelUnsupported(ValueError):
    """The model cannot be split the way the layout asks (a start-up refusal)."""


@dataclass(frozen=True)
class ParallelGroups:
    """This rank's process groups along each model-splitting axis (None: degree 1).

    The ``lent_`` groups exist in CFG gangs: the sp (Ulysses, ring) ranks of both
    CFG branches together, which a request without true CFG splits its sequence
    over instead of running twice (``lent_ring_ranks``: that ring's ranks).
    """

    tp: dist.ProcessGroup | None = None
    sp: dist.ProcessGroup | None = None
    ulysses: dist.ProcessGroup | None = None
    ring: dist.ProcessGroup | None = None
    lent_sp: dist.ProcessGroup | None = None
    lent_ulysses: dist.ProcessGroup | None = None
    lent_ring: dist.ProcessGroup | None = None
    lent_ring_ranks: tuple[int, ...] = ()


class ModelParallel:
    def __init__(self, info: RankInfo, groups: ParallelGroups, layout: ParallelConfig) -> None:
        self.info = info
        self.layout = layout
        sp, cfg = layout.sp, layout.cfg
        self.groups = groups
        self.scope = AttentionScope()
        # Each prepared transformer's exchanges (a weight update brings a new one,
        # and the old one serves on until the swap).
        self._tensor: weakref.WeakKeyDictionary[torch.nn.Module, TensorParallel] = (
            weakref.WeakKeyDictionary()
        )
        self.split: SequenceSplit | None = None
        self.cut: SequenceCut | None = None  # the prepared transformer's (``prepare``)
        self.read_report: ReadReport | None = None  # the last ``read_transformer``'s
        if groups.sp is not None and sp > 1:
            sequence = SequenceGroups(groups.ulysses, groups.ring, info.ring_group, info.ring_rank)
            self.split = SequenceSplit(groups.sp, info.sp_rank, sp, sequence, self.scope)
        # Without true CFG the CFG ranks join the split: sp * cfg ways, the CFG pair an
        # extra Ulysses factor where the heads allow (chosen at load) or else a ring one.
        self.lending: str | None = None  # "ulysses", "ring", or None: such requests run twice
        self._lent_choices: dict[str, SequenceSplit] = {}
        if groups.lent_sp is not None and groups.lent_ring is not None:
            lent_rank, degree = info.sp_rank + sp * info.cfg_rank, sp * cfg
            choices = {
                "ulysses": SequenceGroups(
                    groups.lent_ulysses, groups.ring, info.ring_group, info.ring_rank
                ),
                "ring": SequenceGroups(
                    groups.ulysses,
                    groups.lent_ring,
                    groups.lent_ring_ranks,
                    info.ring_rank + layout.ring * info.cfg_rank,
                ),
            }
            self._lent_choices = {
                name: SequenceSplit(groups.lent_sp, lent_rank, degree, seq, self.scope)
                for name, seq in choices.items()
            }

    @property
    def active(self) -> bool:
        """Whether the layout asks to split the transformer (tp or sp)."""
        return self.layout.tp > 1 or self.layout.sp > 1

    @property
    def sharded(self) -> bool:
        """Whether ranks hold different pieces of the transformer."""
        return self.layout.tp > 1

    # ------------------------------------------------------------ loading

    def check(self, transformer: Any) -> None:
        """Refuse, naming the constraint, a transformer this layout cannot split."""
        if not self.active:
            return
        problem = splittable_problem(type(transformer).__name__, self.layout)
        if transformer is None or problem is not None:
            raise ParallelUnsupported(problem or "this pipeline has no transformer")
        try:
            self.layout.validate(num_heads=int(transformer.config.num_attention_heads))
            if self.sharded:
                self._tensor_plan(transformer).check(transformer)
        except ValueError as exc:  # LayoutError, or a layer tp cannot cut
            raise ParallelUnsupported(str(exc)) from None

    def check_loaded(self, pipe: Any, text_tokens: int | None) -> None:
        """What is known once the pipeline is loaded: it has a transformer (prepared by
        ``prepare``), its text tokens split evenly over the sp ranks where sp splits
        them, and its timesteps are one per video (Wan 2.2 TI2V's are per token).
        A second denoiser (Wan 2.2's ``transformer_2``) was prepared as the first was,
        and the denoiser stack patches whichever the pipeline calls."""
        config: Any = getattr(pipe, "config", {})
        if config.get("expand_timesteps"):
            self.lending = None  # its calls cannot be cut (wan.WanCut)
            if self.layout.sp > 1:
                raise ParallelUnsupported(
                    f"sp cannot split {type(pipe).__name__} with per-token timesteps "
                    f"(expand_timesteps): use --cfg and more replicas instead"
                )
        if not self.active:
            return
        transformer = getattr(pipe, "transformer", None)
        if transformer is None:
            kind = type(pipe).__name__ + " without one"
            raise ParallelUnsupported(splittable_problem(kind, self.layout) or kind)
        clip = int(getattr(pipe, "tokenizer_max_length", 77))  # SD3's CLIP tokens
        kind = type(transformer).__name__
        if problem := text_tokens_problem(kind, text_tokens, self.layout.sp, clip):
            raise ParallelUnsupported(problem)

    def _lend_as(self, transformer: Any) -> str | None:
        """How requests without true CFG split over the CFG ranks, if they can."""
        if not self._lent_choices:
            return None
        if plan_of(transformer).cut is None:
            log.info("CFG ranks run requests without true CFG whole: the transformer can't split")
            return None
        heads = int(transformer.config.num_attention_heads) // self.layout.tp
        return "ulysses" if heads % (self.layout.ulysses * self.layout.cfg) == 0 else "ring"

    def _tensor_plan(self, transformer: torch.nn.Module) -> TensorParallel:
        assert self.groups.tp is not None
        tensor_plan = plan_of(transformer).tensor_plan
        assert tensor_plan is not None  # check() refused the layout otherwise
        return TensorParallel(
            tensor_plan(transformer), self.groups.tp, self.info.tp_rank, self.layout.tp
        )

    def prepare(self, transformer: Any) -> Any:
        """Shard a freshly loaded transformer and attach the exchanges; returns it."""
        self.lending = self._lend_as(transformer)
        if not self.active and self.lending is None:
            return transformer
        if self.active:
            self.check(transformer)
        tensor = None
        if self.sharded:
            tensor = self._tensor_plan(transformer)
            tensor.shard(transformer)
        return self._attach(transformer, tensor)

    def read_transformer(self, folder: Path, cls: Any, dtype: torch.dtype) -> Any | None:
        """Under tp, a transformer of class ``cls`` read from ``folder`` (its component
        folder) with only this rank's pieces of the planned layers, then prepared; None
        where today's whole load applies: no tp, or a checkpoint that cannot be read
        piecewise (logged with the reason)."""
        if not self.sharded:
            return None
        try:
            transformer = empty_module(cls, folder)
            self.check(transformer)
            tensor = self._tensor_plan(transformer)
            started = time.perf_counter()
            self.read_report = read_pieces(transformer, folder, dtype, tensor)
        except CannotRead as exc:
            log.warning("%s is loaded whole, then cut: %s", folder, exc)
            return None
        log.info(
            "read tp rank %d's pieces of %s (%.0f%% of its checkpoint) in %.2fs",
            self.info.tp_rank,
            folder,
            100 * self.read_report.share,
            time.perf_counter() - started,
        )
        self.lending = self._lend_as(transformer)
        return self._attach(transformer.eval(), tensor)

    def _attach(self, transformer: Any, tensor: TensorParallel | None) -> Any:
        """Attach the tp exchanges and the sequence split's processors."""
        if tensor is not None:
            tensor.install(transformer)
            self._tensor[transformer] = tensor
        # Outside a split call the processor runs diffusers' own attention.
        plan = plan_of(transformer)
        if plan.cut is not None and plan.processor is not None:
            self.cut = plan.cut()
            transformer.set_attn_processor(plan.processor(self.scope))
        return transformer

    def adapters_changed(self, transformer: torch.nn.Module) -> None:
        """A LoRA load or unload put new modules at the planned paths."""
        tensor = self._tensor.get(transformer)
        if tensor is not None:
            tensor.install(transformer)

    def shard_lora(
        self, transformer: torch.nn.Module, state_dict: Mapping[str, torch.Tensor], prefix: str
    ) -> dict[str, Any]:
        """``state_dict`` with the adapters of ``transformer``'s split layers cut to fit."""
        tensor = self._tensor.get(transformer)
        return dict(state_dict) if tensor is None else tensor.shard_lora(state_dict, prefix)

    # ------------------------------------------------------------ requests

    def wrap(self, forward: Forward, lend: bool) -> Forward:
        """The transformer's forward for one request: sequence-split under sp, and over
        the CFG ranks too when ``lend`` (a CFG gang's request without true CFG) and its
        tokens divide evenly (otherwise both branches' ranks run it, as before)."""
        if self.cut is None:
            return forward
        plain = forward if self.split is None else self.split.wrap(forward, self.cut)
        if lend and self.lending is not None:
            return self._lent_choices[self.lending].wrap(forward, self.cut, fallback=plain)
        return plain
