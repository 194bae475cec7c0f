"""Dynamic batching: which queued generations may share one pipeline call.

Two generations are *compatible* when every request field that shapes the
pipeline call is equal, apart from the ones a batched call takes per image:
prompt, negative prompt text, ``n``, seeds, and the output encoding (applied after
the call). Whether a negative prompt is given at all is in the rule (it decides
true CFG); a field added to ``GenerateParams`` is in it too unless named here.
Edits (their uploads are per request), requests asking for previews (sent per
request, mid-call) and videos (a job's progress is its own, and one video is already
many frames' work) never share a call.

The driver's queue (worker/driver/work_queue.py) takes its first work and then, in queue
order, the compatible generations whose images still fit ``max_images``, passing
over the others (they keep their places) and stopping at a control op or a session
command: those change the state the batch would run in. Every turn starts with the
oldest queued work, so a request passed over waits only for the batches of the work
queued before it, which the requests joining them make longer, not more numerous.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, TypeVar

from dpserve.contract.protocol import (
    GENERATE,
    GenerateParams,
)
from dpserve.worker.commands import GangCommand

T = TypeVar("T")

# Fields a batched call takes per image (or that only the encoding after it reads).
PER_IMAGE: Final = frozenset(
    {"prompt", "negative_prompt", "n", "seed", "output_format", "output_compression"}
)


def batchable(params: GenerateParams) -> bool:
    """May this request share a call? Not an edit, not one that asks for previews, not
    a video."""
    return params.edit is None and params.partial_images == 0 and params.video is None


def compatible(a: GenerateParams, b: GenerateParams) -> bool:
    """Can ``a`` and ``b`` run as one pipeline call (see the module's docstring)?"""
    if not (batchable(a) and batchable(b)):
        return False
    if (a.negative_prompt is None) != (b.negative_prompt is None):
        return False
    return all(
        getattr(a, name) == getattr(b, name)
        for name in a.__struct_fields__
        if name not in PER_IMAGE
    )


@dataclass(frozen=True)
class Batching:
    """How the driver gathers a batch: at most ``max_images`` images in one call, and
    ``wait_s``, how long a batch of two or more requests that is not full waits for
    more (a request with nothing compatible queued behind it starts at once)."""

    max_images: int = 1
    wait_s: float = 0.0

    def grows(self, first: GangCommand) -> bool:
        """May anything join a batch that starts with ``first``?"""
        if first.kind != GENERATE or len(first.batch) != 1:
            return False
        params = first.batch[0].params
        return batchable(params) and params.n < self.max_images

    def full(self, batch: Sequence[GangCommand]) -> bool:
        return images(batch) >= self.max_images

    def joiners(
        self, batch: Sequence[GangCommand], queued: Sequence[GangCommand]
    ) -> tuple[list[int], bool]:
        """The positions in ``queued`` of the generations that join ``batch`` (which
        ``grows``), in order, and whether the look stopped at a control op or a session
        command, past which nothing may join."""
        first = batch[0].batch[0].params
        room = self.max_images - images(batch)
        taken: list[int] = []
        for i, command in enumerate(queued):
            if command.kind != GENERATE:
                return taken, True
            params = command.batch[0].params
            if params.n <= room and compatible(first, params):
                taken.append(i)
                room -= params.n
                if room == 0:
                    break
        return taken, False


def images(batch: Sequence[GangCommand]) -> int:
    return sum(g.params.n for command in batch for g in command.batch)


def split(items: Sequence[T], batch: Sequence[GenerateParams]) -> list[list[T]]:
    """A batched call's outputs (one per image, in batch order) back per request."""
    out: list[list[T]] = []
    start = 0
    for params in batch:
        out.append(list(items[start : start + params.n]))
        start += params.n
    if start != len(items):
        raise ValueError(f"{len(items)} outputs for a batch of {start} images")
    return out
