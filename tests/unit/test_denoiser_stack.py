"""The denoiser's layers run in the order ``worker/denoiser_stack.py`` states.

A tiny denoiser stands in for the transformer: its class forward and a block
hooked like diffusers' step caches write into one trace, and each wrapping layer
(the compiler, the sequence split) writes its name when it runs. The trace after
a call is the order the layers saw it, from the pipeline down to the math.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from dpserve.contract import protocol as p
from dpserve.worker.compile import Compiler
from dpserve.worker.denoiser import Forward, Halted, StopGate
from dpserve.worker.denoiser_stack import DenoiserStack

CACHE = p.StepCache(type="first_block_cache", threshold=0.08)


class _Denoiser(torch.nn.Module):
    """Records its forward, the cache context its block ran in, and the stance."""

    def __init__(self, trace: list[str]) -> None:
        super().__init__()
        self.trace = trace
        self.context: str | None = None
        self.hooked = False  # the step cache's hooks on its block (enable_cache)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        self.trace.append("forward")
        if self.hooked:
            self.trace.append(f"cache hook in {self.context}")
        return hidden_states + 1

    def enable_cache(self, config: Any) -> None:
        self.trace.append("enable_cache")
        self.hooked = True

    def disable_cache(self) -> None:
        self.trace.append("disable_cache")
        self.hooked = False

    @contextlib.contextmanager
    def cache_context(self, name: str) -> Iterator[None]:
        outer, self.context = self.context, name
        try:
            yield
        finally:
            self.context = outer


class _Compiler(Compiler):
    """Tags the forward instead of compiling it; records the stance's span."""

    def __init__(self, trace: list[str]) -> None:
        super().__init__(((64, 64),))
        self.trace = trace

    def compiled(self, forward: Forward) -> Forward:
        def run(*args: Any, **kwargs: Any) -> Any:
            self.trace.append("compiled")
            return forward(*args, **kwargs)

        return run

    @contextlib.contextmanager
    def stance(self) -> Iterator[None]:
        self.trace.append("stance in")
        try:
            yield
        finally:
            self.trace.append("stance out")


def _sequence(trace: list[str], lent: list[bool]) -> Any:
    def wrap(forward: Forward, lend: bool) -> Forward:
        lent.append(lend)

        def run(*args: Any, **kwargs: Any) -> Any:
            trace.append("sequence split")
            return forward(*args, **kwargs)

        return run

    return wrap


def _gate(trace: list[str], halt: p.RequestError | None = None) -> StopGate:
    def check() -> p.RequestError | None:
        trace.append("stop gate")
        return halt

    return StopGate(None, 0, check)


def _one_call(stack: DenoiserStack, denoiser: _Denoiser, cache: p.StepCache | None) -> None:
    with stack.applied(denoiser, False, cache, _gate(denoiser.trace)):
        denoiser(torch.zeros(1))


def test_a_call_runs_from_the_pipeline_down_to_the_math_in_the_stated_order() -> None:
    trace: list[str] = []
    lent: list[bool] = []
    denoiser = _Denoiser(trace)
    stack = DenoiserStack(
        0, None, lambda: trace.append("tick"), _sequence(trace, lent), _Compiler(trace)
    )
    _one_call(stack, denoiser, None)
    assert trace == [
        "stance in",
        "tick",
        "stop gate",
        "sequence split",
        "compiled",
        "forward",
        "stance out",
    ]
    assert "forward" not in denoiser.__dict__ and "cache_context" not in denoiser.__dict__


def test_the_step_cache_hooks_run_inside_the_forward_in_the_call_wide_context() -> None:
    trace: list[str] = []
    denoiser = _Denoiser(trace)
    stack = DenoiserStack(0, None, lambda: trace.append("tick"), _sequence(trace, []))
    _one_call(stack, denoiser, CACHE)
    assert trace == [
        "enable_cache",
        "tick",
        "stop gate",
        "sequence split",
        "forward",
        "cache hook in cond",
        "disable_cache",
    ]
    assert not denoiser.hooked and denoiser.context is None


def test_the_stop_gate_stops_a_call_before_any_layer_below_it() -> None:
    trace: list[str] = []
    denoiser = _Denoiser(trace)
    stack = DenoiserStack(
        0, None, lambda: trace.append("tick"), _sequence(trace, []), _Compiler(trace)
    )
    halt = p.RequestError(p.CANCELLED, "request r was cancelled")
    with pytest.raises(Halted), stack.applied(denoiser, False, CACHE, _gate(trace, halt)):
        denoiser(torch.zeros(1))
    stopped = ["stance in", "enable_cache", "tick", "stop gate", "disable_cache", "stance out"]
    assert trace == stopped
    assert "forward" not in denoiser.__dict__ and not denoiser.hooked


@pytest.mark.parametrize(
    ("compiled", "cache", "lent"),
    [(False, None, True), (True, None, False), (False, CACHE, False)],
)
def test_only_a_plain_call_is_lent_to_the_cfg_ranks_sequence_split(
    compiled: bool, cache: p.StepCache | None, lent: bool
) -> None:
    """A CFG gang's request without true CFG (no CFG split) may be split over the CFG
    ranks, unless it is compiled or cached."""
    trace: list[str] = []
    lends: list[bool] = []
    denoiser = _Denoiser(trace)
    group: Any = object()  # a CFG group; no collective runs without a CFG split
    compiler = _Compiler(trace) if compiled else None
    stack = DenoiserStack(1, group, lambda: None, _sequence(trace, lends), compiler)
    _one_call(stack, denoiser, cache)
    assert lends == [lent]


def test_under_a_cfg_split_the_hooks_see_the_branch_and_the_gate_skips_its_second() -> None:
    """The patch's ``cache_context`` marks the branch and enters the denoiser's own, so
    the step cache keeps each branch's state apart; at the second branch the gate is
    not asked (a lone second-branch call has no first prediction to exchange)."""
    trace: list[str] = []
    lends: list[bool] = []
    denoiser = _Denoiser(trace)
    group: Any = object()
    stack = DenoiserStack(1, group, lambda: trace.append("tick"), _sequence(trace, lends))
    with stack.applied(denoiser, True, CACHE, _gate(trace)):
        with denoiser.cache_context("uncond"):
            denoiser(torch.zeros(1))
        assert "cache_context" in denoiser.__dict__
    assert trace == [
        "enable_cache",
        "tick",
        "sequence split",
        "forward",
        "cache hook in uncond",
        "disable_cache",
    ]
    assert lends == [False] and "cache_context" not in denoiser.__dict__
