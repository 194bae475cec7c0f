"""--compile on a real one-rank executor in process (the tiny Flux model): warm-up
compiles one graph per compile size and nothing compiles afterwards; other shapes run
eager and give the eager image. Inductor on a CPU: ~70 s cold, ~15 s with its cache."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from PIL import Image

from dpserve.config.worker import WorkerConfig
from tests.executors import one_rank_executors, reply_to
from tests.workers import free_port

torch = pytest.importorskip("torch")

from dpserve.worker.compile import graphs  # noqa: E402
from dpserve.worker.executor import Executor  # noqa: E402

BASE = dict(prompt="a red fox", width=64, height=64, num_inference_steps=3, seed=[5])


@pytest.fixture(scope="module")
def executors(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A compiled executor (warmed at 64x64 by rank.py's warm-up) and an eager one."""
    from dpserve.worker.boot import warmup as _warmup

    eager_cfg = WorkerConfig(model=tiny_model, port=free_port(), device="cpu")
    compiled_cfg = WorkerConfig(
        model=tiny_model, port=free_port(), device="cpu", compile=True, compile_sizes=("64x64",)
    )
    configs = (eager_cfg, compiled_cfg)
    with one_rank_executors(configs, tmp_path_factory.mktemp("gang")) as (eager, compiled):
        before = graphs()
        _warmup(compiled, compiled_cfg)
        yield compiled, eager, graphs() - before


def _image(executor: Executor, **fields: Any) -> bytes:
    return reply_to(executor, {**BASE, **fields}).blobs[0]


def _max_diff(a: bytes, b: bytes) -> int:
    x, y = (np.asarray(Image.open(io.BytesIO(i)), dtype=np.int16) for i in (a, b))
    return int(np.abs(x - y).max())


def test_warmup_compiles_the_sizes_and_requests_compile_nothing(executors: Any) -> None:
    compiled, eager, warmup_graphs = executors
    assert warmup_graphs == 1
    assert msgspec.to_builtins(compiled.ops.info)["compile"] == {
        "sizes": ["64x64"],
        "warmup_graphs": 1,
        "other_shapes": "eager",
    }
    after_warmup = graphs()
    # The warmed size runs its graph: eager's image within float rounding.
    assert _max_diff(_image(compiled), _image(eager)) <= 1
    # Another size and a batch of two: eager, so the eager images exactly.
    assert _image(compiled, width=96) == _image(eager, width=96)
    two = dict(n=2, seed=[1, 2])
    assert _image(compiled, **two) == _image(eager, **two)
    assert graphs() == after_warmup
    # CFG in one process: both branches through the same graph.
    cfg = dict(negative_prompt="blurry", true_cfg_scale=3.0)
    assert _max_diff(_image(compiled, **cfg), _image(eager, **cfg)) <= 1
    assert graphs() == after_warmup
