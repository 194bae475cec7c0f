"""Control ops load only from allowed folders, and only safetensors.

One rank's ControlOps on the real tiny pipeline (as test_control_rollback): every
refusal is one message whatever the cause, leaves the state as it was, and a pickle
checkpoint, even a well-formed one the loaders would read, is never unpickled.
"""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dpserve.contract.layout import ParallelConfig, rank_info
from dpserve.contract.protocol import (
    ControlRequest,
    RequestError,
)
from dpserve.worker.control import ControlOps
from dpserve.worker.parallel import ModelParallel, ParallelGroups
from dpserve.worker.paths import REFUSED
from dpserve.worker.pipeline import load_pipeline


class _Touch:
    """Unpickling this creates a file: the proof that a pickle was read."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[Path]]:
        return (Path.touch, (self.marker,))


def _ops(model: Path, *allow: Path) -> ControlOps:
    torch.set_num_threads(1)
    layout = ParallelConfig()
    parallel = ModelParallel(rank_info(layout, 0), ParallelGroups(), layout)
    pipe = load_pipeline(model, torch.device("cpu"), torch.float32, parallel.prepare)
    return ControlOps(pipe, model, torch.device("cpu"), None, parallel, allow_paths=allow)


@pytest.fixture()
def root(tmp_path: Path) -> Path:
    (tmp_path / "allowed").mkdir()
    return tmp_path / "allowed"


@pytest.fixture()
def ops(tiny_model: Path, root: Path) -> ControlOps:
    return _ops(tiny_model, root)


def _refused(ops: ControlOps, op: str, **args: object) -> RequestError:
    before = ops.state()
    with pytest.raises(RequestError) as err:
        ops.run(ControlRequest(op=op, args=dict(args)), lambda ok: ok)
    assert err.value.code == "invalid_request"
    assert ops.state() == before
    return err.value


def test_adapters_and_weights_outside_the_roots_are_refused_alike(
    ops: ControlOps, root: Path, tmp_path: Path, tiny_lora: Path, tiny_model_b: Path
) -> None:
    outside = shutil.copytree(tiny_lora, tmp_path / "outside-lora")  # loadable, but elsewhere
    (root / "escape").symlink_to(outside)
    paths = [outside, tmp_path / "missing", root / "missing", root / "escape", root / ".." / "x"]
    messages = {str(_refused(ops, "set_lora", lora_nickname="s", lora_path=str(p))) for p in paths}
    assert messages == {f"lora_path {REFUSED}"}
    elsewhere = (tiny_model_b, tmp_path / "missing")
    op = "update_weights_from_disk"
    weights = {_refused(ops, op, model_path=str(p)).fields[0].message for p in elsewhere}
    assert weights == {REFUSED}
    # Inside a root it loads, and the state names it as the caller did.
    inside = shutil.copytree(tiny_lora, root / "style")
    done = ops.run(
        ControlRequest(op="set_lora", args={"lora_nickname": "s", "lora_path": str(inside)}),
        lambda ok: ok,
    )
    assert done["changed"] is True and ops.loras.loaded == {"s": str(inside)}


def test_a_router_state_naming_a_forbidden_folder_is_refused_too(
    ops: ControlOps, tmp_path: Path, tiny_lora: Path
) -> None:
    outside = shutil.copytree(tiny_lora, tmp_path / "outside-lora")
    doc = ops.held().successor("set_lora", ops.state())
    state = doc.to_builtins()
    state["state"]["loras"] = {"s": str(outside)}
    state["state"]["active"] = {"s": 1.0}
    err = _refused_state(ops, state)
    assert err.fields[0].message == REFUSED


def _refused_state(ops: ControlOps, state: dict[str, object]) -> RequestError:
    before = ops.state()
    with pytest.raises(RequestError) as err:
        ops.run(ControlRequest(op="sync_state", state=state), lambda ok: ok)
    assert ops.state() == before
    return err.value


def test_pickle_adapters_are_refused_and_never_unpickled(
    ops: ControlOps, root: Path, tmp_path: Path, tiny_lora: Path
) -> None:
    marker = tmp_path / "unpickled"
    pickle.loads(pickle.dumps(_Touch(tmp_path / "live")))  # the payload works when read
    assert (tmp_path / "live").exists()
    # A well-formed torch.save of the very adapter (diffusers would read it) ...
    (root / "benign").mkdir()
    tensors = load_file(str(tiny_lora / "pytorch_lora_weights.safetensors"))
    torch.save(tensors, root / "benign" / "pytorch_lora_weights.bin")
    # ... and one whose reading runs code.
    (root / "evil").mkdir()
    (root / "evil" / "pytorch_lora_weights.bin").write_bytes(pickle.dumps(_Touch(marker)))
    for name in ("benign", "evil"):
        err = _refused(ops, "set_lora", lora_nickname="s", lora_path=str(root / name))
        assert "safetensors only" in str(err) and "pytorch_lora_weights.bin" in str(err)
    # Beside a safetensors file a pickle is left unread, and the adapter loads.
    mixed = shutil.copytree(tiny_lora, root / "mixed")
    (mixed / "adapter_model.bin").write_bytes(pickle.dumps(_Touch(marker)))
    ops.run(
        ControlRequest(op="set_lora", args={"lora_nickname": "s", "lora_path": str(mixed)}),
        lambda ok: ok,
    )
    assert ops.loras.loaded == {"s": str(mixed)}
    assert not marker.exists()


def _pickle_transformer(model: Path, copy: Path, payload: object) -> Path:
    shutil.copytree(model, copy)
    folder = copy / "transformer"
    for weights in folder.glob("*.safetensors"):
        weights.unlink()
    (folder / "diffusion_pytorch_model.bin").write_bytes(pickle.dumps(payload))
    return copy


def test_pickle_weights_are_refused_at_update_and_at_start_up(
    ops: ControlOps, root: Path, tmp_path: Path, tiny_model: Path
) -> None:
    marker = tmp_path / "unpickled"
    model = _pickle_transformer(tiny_model, root / "pickled", _Touch(marker))
    err = _refused(ops, "update_weights_from_disk", model_path=str(model))
    assert err.fields[0].field == "model_path" and "safetensors only" in str(err)
    with pytest.raises(ValueError, match="safetensors only"):
        load_pipeline(model, torch.device("cpu"), torch.float32)
    assert not marker.exists()
