"""A tp rank's transformer read piece by piece from its checkpoint: the same tensors as
loading it whole and cutting it, only this rank's bytes read, from a single file or a
sharded index; a checkpoint whose keys or shapes are not the module's is never guessed."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from diffusers.models.transformers.transformer_flux import FluxTransformer2DModel  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from dpserve.contract.layout import ParallelConfig, rank_info  # noqa: E402
from dpserve.worker.parallel import ModelParallel, ParallelGroups, shard_read  # noqa: E402
from dpserve.worker.parallel.flux import flux_plan  # noqa: E402
from dpserve.worker.parallel.shard_read import (  # noqa: E402
    INDEX,
    WEIGHTS,
    CannotRead,
    ReadReport,
    empty_module,
    read_pieces,
)
from dpserve.worker.parallel.tensor import TensorParallel  # noqa: E402


def _cut_whole(
    folder: Path, rank: int, degree: int, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """Today's path: the whole module loaded, then cut (``TensorParallel.shard``)."""
    module = FluxTransformer2DModel.from_pretrained(folder, dtype=dtype)
    TensorParallel(flux_plan(module), None, rank, degree).shard(module)  # type: ignore[arg-type]
    return module.state_dict()


def _read(
    folder: Path, rank: int, degree: int, dtype: torch.dtype = torch.float32
) -> tuple[torch.nn.Module, ReadReport]:
    module = empty_module(FluxTransformer2DModel, folder)
    tensor = TensorParallel(flux_plan(module), None, rank, degree)  # type: ignore[arg-type]
    return module, read_pieces(module, folder, dtype, tensor)


def _sharded_copy(folder: Path, out: Path) -> Path:
    """``folder``'s checkpoint as three files and a ``.index.json``, as large models ship."""
    out.mkdir()
    shutil.copy(folder / "config.json", out)
    tensors = load_file(folder / WEIGHTS)
    keys = sorted(tensors)
    weight_map = {}
    for i in range(3):
        name = f"diffusion_pytorch_model-{i + 1:05d}-of-00003.safetensors"
        part = {k: tensors[k].contiguous() for k in keys[i::3]}
        save_file(part, out / name)
        weight_map |= dict.fromkeys(part, name)
    (out / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


@pytest.mark.parametrize("degree", [2, 4])
def test_each_rank_reads_exactly_the_pieces_a_whole_load_would_cut(
    tiny4_model: Path, degree: int
) -> None:
    folder = tiny4_model / "transformer"
    for rank in range(degree):
        module, report = _read(folder, rank, degree)
        want = _cut_whole(folder, rank, degree)
        got = module.state_dict()
        assert sorted(got) == sorted(want)
        for key, value in want.items():
            assert got[key].shape == value.shape and torch.equal(got[key], value), key
        assert not any(t.is_meta for t in [*module.parameters(), *module.buffers()])
        # Every cut tensor of every planned layer: exactly its 1/degree read, never whole.
        assert report.split and report.largest(report.split) == pytest.approx(1 / degree)
        assert {k.rpartition(".")[0] for k in report.split} == set(flux_plan(module))
        assert report.share < 0.5 + 1 / degree
        for path in flux_plan(module):
            linear = module.get_submodule(path)
            assert (linear.out_features, linear.in_features) == linear.weight.shape


@pytest.mark.parametrize("mapped", [shard_read.MAPPED_BYTES, 1])
def test_a_sharded_checkpoint_reads_like_a_single_file(
    tiny4_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mapped: int
) -> None:
    """Also when each file is reopened after every tensor (``MAPPED_BYTES``)."""
    monkeypatch.setattr(shard_read, "MAPPED_BYTES", mapped)
    sharded = _sharded_copy(tiny4_model / "transformer", tmp_path / "transformer")
    assert not (sharded / WEIGHTS).exists()
    module, report = _read(sharded, 1, 2)
    want = _cut_whole(tiny4_model / "transformer", 1, 2)
    assert sorted(report.whole) == sorted(want)
    assert all(torch.equal(module.state_dict()[k], v) for k, v in want.items())


def test_pieces_come_in_the_pipeline_dtype_as_a_whole_load_casts_them(tiny4_model: Path) -> None:
    module, _ = _read(tiny4_model / "transformer", 0, 2, torch.bfloat16)
    want = _cut_whole(tiny4_model / "transformer", 0, 2, torch.bfloat16)
    got = module.state_dict()
    assert {v.dtype for v in got.values() if v.is_floating_point()} == {torch.bfloat16}
    assert all(torch.equal(got[k], v) for k, v in want.items())


def test_checkpoints_that_are_not_the_module_are_refused_not_guessed(
    tiny4_model: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "transformer"
    folder.mkdir()
    shutil.copy(tiny4_model / "transformer" / "config.json", folder)
    tensors = load_file(tiny4_model / "transformer" / WEIGHTS)
    old = "transformer_blocks.0.attn.to_q"
    renamed = {
        ("blocks.0.q" + k[len(old) :] if k.startswith(old) else k): v for k, v in tensors.items()
    }
    save_file(renamed, folder / WEIGHTS)
    with pytest.raises(CannotRead, match=r"keys are not FluxTransformer2DModel's \(2 missing"):
        _read(folder, 0, 2)
    key = "proj_out.weight"
    save_file({**tensors, key: tensors[key][:, :-1].contiguous()}, folder / WEIGHTS)
    with pytest.raises(CannotRead, match=r"proj_out.weight is \[\d+, \d+\] in the checkpoint"):
        _read(folder, 0, 2)
    (folder / WEIGHTS).unlink()
    with pytest.raises(CannotRead, match="has neither"):
        _read(folder, 0, 2)


def test_a_rank_falls_back_to_the_whole_load_saying_why(
    tiny4_model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    layout = ParallelConfig(tp=2)
    groups = ParallelGroups(tp=object())  # type: ignore[arg-type]  # no exchange runs here
    parallel = ModelParallel(rank_info(layout, 1), groups, layout)
    flux, fp32 = FluxTransformer2DModel, torch.float32
    read = parallel.read_transformer(tiny4_model / "transformer", flux, fp32)
    assert read is not None and parallel.read_report is not None
    assert read.transformer_blocks[0].attn.to_q.out_features == 32  # 4 heads x 16, halved
    folder = tmp_path / "transformer"
    folder.mkdir()
    shutil.copy(tiny4_model / "transformer" / "config.json", folder)
    with caplog.at_level(logging.WARNING, logger="dpserve.worker.parallel"):
        assert parallel.read_transformer(folder, flux, fp32) is None
    assert "is loaded whole, then cut: " in caplog.text and "has neither" in caplog.text
    one = ParallelConfig()
    whole = ModelParallel(rank_info(one, 0), ParallelGroups(), one)
    assert (
        whole.read_transformer(tiny4_model / "transformer", FluxTransformer2DModel, torch.float32)
        is None
    )


def test_a_weight_update_reads_the_new_checkpoint_piecewise_too(
    tiny_model: Path, tiny_model_b: Path
) -> None:
    from dpserve.contract.control_state import ControlState, WeightSource
    from dpserve.worker.converge import StateApplier
    from dpserve.worker.pipeline import load_pipeline

    layout = ParallelConfig(tp=2)
    groups = ParallelGroups(tp=object())  # type: ignore[arg-type]  # no forward runs here
    parallel = ModelParallel(rank_info(layout, 1), groups, layout)
    cpu, fp32 = torch.device("cpu"), torch.float32
    pipe = load_pipeline(tiny_model, cpu, fp32, parallel.prepare, None, parallel.read_transformer)
    booted = parallel.read_report
    assert booted is not None
    applier = StateApplier(pipe, tiny_model, cpu, parallel, allow_paths=(tiny_model_b.parent,))
    source = WeightSource(str(tiny_model_b), revision=1)
    applier.apply(ControlState(weights={"transformer": source}))
    assert parallel.read_report is not booted and parallel.read_report is not None
    assert parallel.read_report.largest(parallel.read_report.split) == pytest.approx(0.5)
    want = _cut_whole(tiny_model_b / "transformer", 1, 2)
    got = pipe.transformer.state_dict()
    assert all(torch.equal(got[k], v) for k, v in want.items())
