"""A control op that fails on one rank of a gang is undone on every rank.

The ranks agree after applying; this runs one rank's ControlOps on the real tiny
pipeline with the gang's vote forced, so "another rank failed" is exactly what
this rank sees, and checks it returns to the weights and adapters it had.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dpserve.contract.layout import ParallelConfig, rank_info
from dpserve.contract.protocol import (
    ControlRequest,
    RequestError,
)
from dpserve.worker.control import ControlOps, GangDiverged, PeerFailed
from dpserve.worker.parallel import ModelParallel, ParallelGroups
from dpserve.worker.pipeline import load_pipeline
from dpserve.worker.weights import checksum, modules_of


@pytest.fixture()
def ops(tiny_model: Path, tiny_lora: Path) -> ControlOps:
    torch.set_num_threads(1)
    layout = ParallelConfig()
    parallel = ModelParallel(rank_info(layout, 0), ParallelGroups(), layout)
    pipe = load_pipeline(tiny_model, torch.device("cpu"), torch.float32, parallel.prepare)
    allow = (tiny_lora.parent,)
    return ControlOps(pipe, tiny_model, torch.device("cpu"), None, parallel, allow_paths=allow)


def _sums(ops: ControlOps) -> dict[str, str]:
    return {n: checksum(m) for n, m in modules_of(ops.pipe.components).items()}


def _run(ops: ControlOps, op: str, votes: list[bool], **args: object) -> dict[str, object]:
    """Run ``op`` with the other ranks' answers to each agree() call taken from ``votes``."""
    asked = iter(votes)
    return ops.run(ControlRequest(op=op, args=dict(args)), lambda ok: ok and next(asked))


def _set(ops: ControlOps, votes: list[bool], **args: object) -> dict[str, object]:
    return _run(ops, "set_lora", votes, **args)


def test_a_peer_failure_undoes_the_adapter_on_this_rank(ops: ControlOps, tiny_lora: Path) -> None:
    before_state, before_sums = ops.state(), _sums(ops)
    with pytest.raises(PeerFailed, match="nothing changed"):
        _set(ops, [False, True], lora_nickname="s", lora_path=str(tiny_lora))
    assert ops.state() == before_state and ops.loras.loaded == {}
    assert _sums(ops) == before_sums
    # The same op then succeeds when every rank does.
    done = _set(ops, [True], lora_nickname="s", lora_path=str(tiny_lora))
    assert done["active"] == [{"nickname": "s", "strength": 1.0}] and done["changed"] is True
    merged_sums = _sums(ops)
    with pytest.raises(PeerFailed):
        _run(ops, "merge_lora_weights", [False, True])
    assert ops.state().merged is None and _sums(ops) == merged_sums


def test_own_failure_reports_its_reason_and_keeps_state(ops: ControlOps) -> None:
    with pytest.raises(RequestError) as err:
        _set(ops, [True, True], lora_nickname="s", lora_path="/no/such/lora")
    assert not isinstance(err.value, PeerFailed) and err.value.fields[0].field == "lora_path"
    assert ops.loras.loaded == {}


def test_a_rank_that_cannot_undo_stops_the_gang(ops: ControlOps, tiny_lora: Path) -> None:
    with pytest.raises(GangDiverged):
        _set(ops, [False, False], lora_nickname="s", lora_path=str(tiny_lora))
