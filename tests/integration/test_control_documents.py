"""A replica takes a router's document for an op only over one it was made knowing.

One rank's ControlOps on the real tiny pipeline: two routers that built on the
same state cannot undo each other here, whatever their ids; the one built again
on top (the router's retry, dpserve/router/control_plane.py) is taken, and the document
the replica reports carries what it was made knowing.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dpserve.contract.control_state import StateDoc, newest, reduce
from dpserve.contract.layout import ParallelConfig, rank_info
from dpserve.contract.protocol import (
    CONFLICT,
    SYNC_STATE,
    ControlRequest,
    RequestError,
)
from dpserve.worker.control import ControlOps
from dpserve.worker.parallel import ModelParallel, ParallelGroups
from dpserve.worker.pipeline import load_pipeline


@pytest.fixture()
def ops(tiny_model: Path, tiny_lora: Path) -> ControlOps:
    torch.set_num_threads(1)
    layout = ParallelConfig()
    parallel = ModelParallel(rank_info(layout, 0), ParallelGroups(), layout)
    pipe = load_pipeline(tiny_model, torch.device("cpu"), torch.float32, parallel.prepare)
    allow = (tiny_lora.parent,)
    return ControlOps(pipe, tiny_model, torch.device("cpu"), None, parallel, allow_paths=allow)


def _doc(base: StateDoc, state_of: StateDoc, args: dict[str, object]) -> StateDoc:
    """``set_lora`` on ``state_of``'s state, in a document made knowing ``base``."""
    return base.successor("set_lora", reduce(state_of.state, "set_lora", args, base.version + 1))


def _send(ops: ControlOps, doc: StateDoc, op: str = "set_lora") -> dict[str, object]:
    return ops.run(ControlRequest(op=op, state=doc.to_builtins()), lambda ok: ok)


def test_an_op_built_on_a_stale_state_is_refused_and_one_built_on_top_applies(
    ops: ControlOps, tiny_lora: Path
) -> None:
    boot = ops.held()
    first = {"lora_nickname": "a", "lora_path": str(tiny_lora)}
    theirs = _doc(boot, boot, first)
    _send(ops, theirs)
    assert ops.loras.loaded == {"a": str(tiny_lora)}
    # Another router, still on the boot state: refused whichever id orders higher.
    mine = _doc(boot, boot, {"lora_nickname": "b", "lora_path": str(tiny_lora)})
    for stale in (mine, StateDoc(version=9, id="zz", state=mine.state, base=boot.key)):
        with pytest.raises(RequestError) as refused:
            _send(ops, stale)
        assert refused.value.code == CONFLICT
        assert "another router changed the state" in str(refused.value)
        assert ops.held() == theirs and ops.loras.loaded == {"a": str(tiny_lora)}
    # Built again on top of theirs (and over its own first try): both adapters.
    top = newest(theirs, mine)
    assert top is not None
    on_top = _doc(top, theirs, {"lora_nickname": "b", "lora_path": str(tiny_lora)})
    done = _send(ops, on_top)
    assert done["changed"] is True
    assert ops.loras.loaded == {"a": str(tiny_lora), "b": str(tiny_lora)}
    assert ops.held() == on_top and ops.held().base == top.key
    # A sync only moves forward.
    with pytest.raises(RequestError) as behind:
        _send(ops, theirs, SYNC_STATE)
    assert behind.value.code == CONFLICT and ops.held() == on_top
