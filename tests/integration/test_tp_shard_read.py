"""Tensor-parallel ranks that read only their pieces of the checkpoint compute exactly
what ranks that load the whole transformer and cut it compute: real gangs, float32,
final latents equal bit for bit, and each rank read half of every split weight."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.parallel_harness import REQUEST, gang_run

pytestmark = pytest.mark.gang

LAYOUTS = {"tp2": dict(tp=2), "tp2xulysses2": dict(tp=2, sp=2, ulysses=2)}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_pieces_read_give_the_latents_of_the_whole_load_cut(name: str, tiny4_model: Path) -> None:
    read, reads = gang_run(tiny4_model, LAYOUTS[name], REQUEST, read=True)
    whole, wholes = gang_run(tiny4_model, LAYOUTS[name], REQUEST, read=False)
    assert torch.equal(read, whole)
    assert all(r["share"] is None for r in wholes)  # today's path: nothing read piecewise
    for r in reads:  # every rank took the piecewise path, half of each split weight
        assert r["split"] == pytest.approx(0.5) and r["largest"] == 1.0
        assert r["share"] is not None and r["share"] < 0.6
