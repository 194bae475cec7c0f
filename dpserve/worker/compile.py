"""``--compile``: the denoiser's forward through ``torch.compile``, warmed per size.

The compiled function is the denoiser class's own ``forward`` (``dynamic=False``:
one graph per input shape), called in place of the module's forward inside the
per-request denoiser patch, so the patch's CFG exchange, stop gate and progress
ticks stay outside the graph (the layers' order: ``denoiser_stack.py``). Warm-up
(worker/boot.py) runs one generation at each ``--compile-size``, compiling its
graph; then the compiler is sealed and serving runs under
``torch.compiler.set_stance("eager_on_recompile")``: a call whose shapes a warmed
graph fits uses it, any other (another size, a batch or ``n`` > 1, a changed
adapter) runs eager, never compiling while a request waits.

Refused with tensor or sequence parallel (their exchanges run inside the
forward) and with step caches (their hooks change the traced blocks, so no warmed
graph would fit a cached call).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, Final

import torch

from dpserve.contract.model_info import CompileInfo

Forward = Callable[..., Any]
MAX_SIZES: Final = 8  # dynamo's default recompile limit: graphs kept per function


def parse_size(text: str) -> tuple[int, int]:
    """A ``--compile-size`` (``WxH``, checked by ``config.compile_size``) as (width, height)."""
    width, _, height = text.partition("x")
    return int(width), int(height)


def graphs() -> int:
    """Graphs dynamo compiled in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class Compiler:
    """The one owner of the compiled forwards and of the serving stance."""

    def __init__(self, sizes: tuple[tuple[int, int], ...]) -> None:
        self.sizes = sizes
        self.sealed = False  # warm-up done: from now on nothing compiles
        self.warmup_graphs = 0
        self._compiled: dict[type, Forward] = {}

    def compiled(self, forward: Forward) -> Forward:
        """``forward`` (a denoiser's bound forward) through its class's compiled one."""
        module = getattr(forward, "__self__", None)
        if not isinstance(module, torch.nn.Module):
            return forward
        cls = type(module)
        if cls not in self._compiled:
            self._compiled[cls] = torch.compile(cls.forward, dynamic=False)
        return functools.partial(self._compiled[cls], module)

    def seal(self, compiled_before: int) -> None:
        """Warm-up is over (it compiled ``graphs() - compiled_before`` graphs)."""
        self.warmup_graphs = graphs() - compiled_before
        self.sealed = True

    @contextlib.contextmanager
    def stance(self) -> Iterator[None]:
        """Around a pipeline call: after warm-up, eager instead of compiling."""
        if not self.sealed:
            yield
            return
        with torch.compiler.set_stance("eager_on_recompile"):
            yield

    def info(self) -> CompileInfo:
        return CompileInfo(
            sizes=[f"{w}x{h}" for w, h in self.sizes],
            warmup_graphs=self.warmup_graphs,
            other_shapes="eager",
        )


def refusal(tp: int, sp: int, step_cache: str | None) -> str | None:
    """Why this set-up cannot compile its denoiser, or None."""
    if tp > 1 or sp > 1:
        return (
            f"--compile is not supported with tensor or sequence parallel (tp={tp}, sp={sp}): "
            "their exchanges run inside the denoiser's forward"
        )
    if step_cache is not None:
        return (
            "--compile and --step-cache do not combine: the cache's hooks change the blocks "
            "the warmed graphs traced"
        )
    return None


def compile_sizes(
    given: tuple[str, ...], default: tuple[int, int], factor: int, max_side: int
) -> tuple[tuple[int, int], ...]:
    """The sizes warm-up compiles (``default``, the pipeline's, when none are given); a
    size no request could ask for is a ``ValueError`` naming it."""
    sizes = tuple(dict.fromkeys(parse_size(s) for s in given)) or (default,)
    if len(sizes) > MAX_SIZES:
        raise ValueError(f"at most {MAX_SIZES} --compile-size, got {len(sizes)}")
    for width, height in sizes:
        if width % factor or height % factor or max(width, height) > max_side:
            raise ValueError(
                f"--compile-size {width}x{height}: sides must be multiples of {factor} "
                f"and at most --max-side {max_side}"
            )
    return sizes
