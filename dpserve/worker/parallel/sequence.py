"""Sequence parallel around one transformer call: the split, the attention scope, and
where each family of transformers is cut.

``SequenceSplit`` wraps a transformer's forward for one request: this rank takes its
slice of the tokens, attention exchanges through the scope's groups, and the output
is gathered whole. Where the tokens are cut is the family's ``SequenceCut``: Flux
takes its token sequence as input (``flux.FluxCut``), Wan makes it from a video
latent inside its forward (``wan.WanCut``).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
import torch.distributed as dist

from dpserve.contract.protocol import (
    INVALID_REQUEST,
    RequestError,
)
from dpserve.worker.parallel.attention import SequenceGroups
from dpserve.worker.parallel.tensor import gather_cat

Forward = Callable[..., Any]


class AttentionScope:
    """The sequence groups the attention of the running call exchanges with.

    Set by ``SequenceSplit`` around a split call; None otherwise, and then the
    processors run diffusers' own attention unchanged (CFG-split calls stay
    bitwise equal to one rank).
    """

    def __init__(self) -> None:
        self.groups: SequenceGroups | None = None

    @contextlib.contextmanager
    def using(self, groups: SequenceGroups) -> Iterator[None]:
        previous, self.groups = self.groups, groups
        try:
            yield
        finally:
            self.groups = previous


class SplitAttention:
    """A family's attention processor: diffusers' own (``whole``) outside a split call
    and for calls that need no exchange (``exchanges``), else the family's ``split``.

    diffusers calls processors positionally: (attn, hidden, encoder hidden, mask,
    rotary embedding).
    """

    def __init__(self, scope: AttentionScope, whole: Any) -> None:
        self.scope = scope
        self.whole = whole

    def exchanges(self, encoder_hidden_states: torch.Tensor | None) -> bool:
        return True

    def split(
        self,
        attn: Any,
        groups: SequenceGroups,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None,
        rotary: Any,
    ) -> Any:
        raise NotImplementedError

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary: Any = None,
    ) -> Any:
        groups = self.scope.groups
        if groups is None or not self.exchanges(encoder_hidden_states):
            return self.whole(attn, hidden_states, encoder_hidden_states, attention_mask, rotary)
        if attention_mask is not None:
            raise RequestError(INVALID_REQUEST, "sequence parallel does not take attention masks")
        return self.split(attn, groups, hidden_states, encoder_hidden_states, rotary)


class Piece(Protocol):
    """This rank's part of a split call's sequence (one of ``degree`` equal parts)."""

    degree: int

    def take(self, tensor: torch.Tensor, dim: int) -> torch.Tensor: ...
    def gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor: ...


class SequenceCut(Protocol):
    """Where a family of transformers is cut along its sequence."""

    def lengths(self, module: Any, call: inspect.BoundArguments) -> list[tuple[str, int]]:
        """The token counts the call splits, each with what the tokens are."""
        ...

    def run(self, module: Any, forward: Forward, call: inspect.BoundArguments, piece: Piece) -> Any:
        """``forward`` on this rank's piece of the tokens, its output gathered whole."""
        ...


class SequenceSplit:
    """Per-call wrapper of the transformer's forward: slice the tokens over ``group``
    (this rank takes slice ``rank`` of ``degree``), attend through ``groups``, gather
    the output."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        rank: int,
        degree: int,
        groups: SequenceGroups,
        scope: AttentionScope,
    ) -> None:
        self.group = group
        self.rank = rank
        self.degree = degree
        self.groups = groups
        self.scope = scope

    def take(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        piece = tensor.shape[dim] // self.degree
        return tensor.narrow(dim, self.rank * piece, piece)

    def gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        return gather_cat(tensor, self.group, dim=dim)

    def wrap(self, forward: Forward, cut: SequenceCut, fallback: Forward | None = None) -> Forward:
        """``forward`` split where ``cut`` says; a call whose tokens do not divide evenly
        goes to ``fallback`` when there is one, and is refused otherwise."""
        signature = inspect.signature(forward)
        module = getattr(forward, "__self__", None)  # the transformer whose forward it is

        def split_forward(*args: Any, **kwargs: Any) -> Any:
            call = signature.bind(*args, **kwargs)
            uneven = [(what, n) for what, n in cut.lengths(module, call) if n % self.degree]
            if uneven and fallback is not None:
                return fallback(*args, **kwargs)
            if uneven:
                raise self._refusal(*uneven[0])
            with self.scope.using(self.groups):
                return cut.run(module, forward, call, self)

        return split_forward

    def _refusal(self, what: str, length: int) -> RequestError:
        return RequestError(
            INVALID_REQUEST,
            f"{length} {what} tokens cannot be split over sp={self.degree} ranks: "
            f"choose a size (or --max-sequence-length, or a frame count) whose token "
            f"count is a multiple of {self.degree}",
        )
