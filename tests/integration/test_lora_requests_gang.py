"""A request's own LoRA adapters on real gangs (CFG-, tensor- and sequence-parallel)
through the ZMQ front: the same image as one rank's and as the gang's own ``set_lora``,
nothing left on after, a bad adapter refused by the whole gang with the next request
unaffected, and the cache's report in pings. One rank in process: test_lora_requests_worker.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dpserve.contract.protocol import RequestError
from tests.workers import WorkerProcess

pytestmark = pytest.mark.gang

TOKENS = ("--max-sequence-length", "64")
REQUEST: dict[str, Any] = dict(
    prompt="a blue teapot",
    negative_prompt="noise",
    true_cfg_scale=3.0,
    width=64,
    height=64,
    num_inference_steps=3,
    seed=11,
)
LAYOUTS = {"cfg2": ("--cfg", "2"), "tp2": ("--tp", "2"), "ulysses2": ("--sp", "2")}


@pytest.fixture(scope="module")
def loras(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    from dpserve.worker.tiny_model import build_tiny_lora

    root = tmp_path_factory.mktemp("gang-loras")
    return [build_tiny_lora(root / f"style-{i}", tiny_model, seed=30 + i) for i in range(2)]


@pytest.fixture(scope="module")
def single(tiny_model: Path, allow_tmp: tuple[str, str]) -> Iterator[WorkerProcess]:
    with WorkerProcess(tiny_model, *TOKENS, *allow_tmp) as w:
        yield w


@pytest.fixture(scope="module", params=list(LAYOUTS))
def gang(
    request: pytest.FixtureRequest, tiny_model: Path, allow_tmp: tuple[str, str]
) -> Iterator[WorkerProcess]:
    with WorkerProcess(tiny_model, *LAYOUTS[request.param], *TOKENS, *allow_tmp) as w:
        yield w


def _png(worker: WorkerProcess, **fields: Any) -> bytes:
    with worker.client() as c:
        return c.generate(**{**REQUEST, **fields})[1][0]


def _close(a: bytes, b: bytes) -> bool:
    import io

    import numpy as np
    from PIL import Image

    x, y = (np.asarray(Image.open(io.BytesIO(i))).astype(np.int16) for i in (a, b))
    return int(np.abs(x - y).max()) <= 1


def test_request_adapters_match_one_rank_and_set_lora(
    single: WorkerProcess, gang: WorkerProcess, loras: list[Path], tiny_model: Path
) -> None:
    stack = [
        {"name": "wash", "path": str(loras[0]), "scale": 0.7},
        {"name": "ink", "path": str(loras[1]), "scale": -0.3},
    ]
    base = _png(gang)
    asked = _png(gang, lora=stack)
    assert not _close(asked, base) and _close(asked, _png(single, lora=stack))
    assert _png(gang) == base  # nothing stays on
    with gang.client() as c:
        c.control(
            "set_lora",
            lora_nickname=["w", "i"],
            lora_path=[str(loras[0]), str(loras[1])],
            strength=[0.7, -0.3],
        )
        try:
            assert _png(gang) == asked  # the gang's own set_lora: the same bytes
            assert _png(gang, lora=[]) == base
        finally:
            c.control("update_weights_from_disk", model_path=str(tiny_model))
        report = c.ping().adapters
    assert _png(gang) == base
    assert report is not None and report.resident == [] and report.pinned == []
    assert set(report.known) == {"wash", "ink"} and report.loads == 2


def test_a_bad_adapter_is_refused_by_the_gang_and_changes_nothing(
    gang: WorkerProcess, loras: list[Path], tmp_path_factory: pytest.TempPathFactory
) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    name = "pytorch_lora_weights.safetensors"
    tensors = load_file(str(loras[0] / name))
    key = "transformer.single_transformer_blocks.0.attn.to_q.lora_A.weight"
    folder = tmp_path_factory.mktemp("bad") / "wider"
    folder.mkdir()
    save_file({**tensors, key: torch.ones(4, 48)}, str(folder / name))
    good = {"name": "wash", "path": str(loras[0]), "scale": 0.7}
    with_good = _png(gang, lora=good)
    base = _png(gang)
    with gang.client() as c:
        before = c.ping().adapters
        with pytest.raises(RequestError) as err:
            c.generate(**{**REQUEST, "lora": [good, {"name": "wider", "path": str(folder)}]})
        after = c.ping().adapters
    assert err.value.status == 400 and "'wider'" in str(err.value)
    assert "does not fit" in str(err.value), str(err.value)
    assert before is not None and after is not None
    assert after.failures == before.failures + 1 and "wider" not in after.known
    assert after.resident == before.resident == ["wash"]
    assert _png(gang) == base and _png(gang, lora="wash") != base
    assert _png(gang, lora={"name": "wash", "scale": 0.7}) == with_good
