"""The stop gate on one rank: asked at every denoiser call, it raises the driver's reason
there, and the patched denoiser is restored whatever happens."""

from __future__ import annotations

import pytest
import torch

from dpserve.contract import protocol as p
from dpserve.worker.denoiser import DenoiserPatch, Halted, StopGate


class _Denoiser(torch.nn.Module):
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states + 1


def test_the_gate_stops_at_the_first_call_after_the_driver_says_so() -> None:
    denoiser, calls = _Denoiser(), []
    reason: list[p.RequestError] = []
    gate = StopGate(None, 0, lambda: reason[0] if reason else None)
    patch = DenoiserPatch(0, None, lambda: calls.append(1))
    x = torch.zeros(2)
    with pytest.raises(Halted) as halted, patch.applied(denoiser, False, gate):
        for step in range(10):
            if step == 3:
                reason.append(p.RequestError(p.DEADLINE_EXCEEDED, "request r passed its deadline"))
            x = denoiser(x)
    assert halted.value.code == p.DEADLINE_EXCEEDED and halted.value.status == 504
    assert "dropped at denoiser call 4" in str(halted.value)
    assert len(calls) == 4 and torch.equal(x, torch.full((2,), 3.0))  # three calls ran
    assert "forward" not in denoiser.__dict__  # the class's forward again
    assert torch.equal(denoiser(torch.zeros(1)), torch.ones(1))


def test_without_a_gate_or_a_reason_nothing_stops() -> None:
    denoiser = _Denoiser()
    patch = DenoiserPatch(0, None, lambda: None)
    with patch.applied(denoiser, False, StopGate(None, 0, None)):
        assert torch.equal(denoiser(torch.zeros(1)), torch.ones(1))
    with patch.applied(denoiser, False):
        assert torch.equal(denoiser(torch.zeros(1)), torch.ones(1))
