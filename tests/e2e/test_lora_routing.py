"""Adapter-aware routing through real processes (docs/lora.md, Routing that knows):
``dpserve serve --dp-size 2`` with the tiny model, requests naming adapters in turn.

What only real processes show: the replicas' pings report what their caches hold, the
router reads them, and one adapter's requests gather on one replica, so each adapter
is loaded once in the fleet; adapter-blind least work (``--adapter-routing blind``)
sends them in turn and loads each adapter on both replicas.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.polling import eventually
from tests.servers import ServeProcess

pytestmark = [pytest.mark.e2e, pytest.mark.rest_lane]

BASE: dict[str, Any] = {"prompt": "a red fox", "size": "64x64", "num_inference_steps": 2, "seed": 5}
ROUNDS = 3


@pytest.fixture(scope="module")
def loras(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    from dpserve.worker.tiny_model import build_tiny_lora

    root = tmp_path_factory.mktemp("routing-loras")
    return [build_tiny_lora(root / f"style-{i}", tiny_model, seed=20 + i) for i in range(3)]


def _serve(tiny_model: Path, allow_tmp: tuple[str, str], routing: str) -> ServeProcess:
    flags = ("--adapter-routing", routing, "--lora-cache-mb", "64", *allow_tmp)
    return ServeProcess(tiny_model, 2, *flags)


@pytest.fixture(scope="module")
def aware(tiny_model: Path, allow_tmp: tuple[str, str]) -> Iterator[ServeProcess]:
    with _serve(tiny_model, allow_tmp, "aware") as running:
        yield running


def _placements(served: ServeProcess, loras: list[Path]) -> dict[str, set[str]]:
    """Each adapter's requests, round after round, sent one at a time: the replicas
    that served them."""
    where: dict[str, set[str]] = {}
    for _ in range(ROUNDS):
        for i, path in enumerate(loras):
            lora = {"name": f"style-{i}", "path": str(path)}
            answer = served.http.post("/v1/images/generations", json={**BASE, "lora": lora})
            assert answer.status_code == 200, answer.text
            where.setdefault(f"style-{i}", set()).add(answer.headers["x-dpserve-replica"])
    return where


def _loads(served: ServeProcess) -> float:
    text = served.http.get("/metrics").text
    found = re.findall(r"^dpserve_lora_cache_loads_total\{[^}]*\} ([0-9.e+]+)$", text, re.M)
    assert found, "no replica reports its adapter cache"
    return sum(float(v) for v in found)


def test_aware_routing_loads_each_adapter_once_in_the_fleet(
    aware: ServeProcess, loras: list[Path]
) -> None:
    where = _placements(aware, loras)
    assert all(len(replicas) == 1 for replicas in where.values()), where
    # The counts come with the replicas' pings: the last load shows at the next one.
    assert eventually(lambda: _loads(aware) >= len(loras), 30, "every load reported")
    assert _loads(aware) == len(loras)
    shown = aware.http.get("/v1/models").json()["data"][0]["adapters"]
    resident = {a["name"]: a["resident"] for a in shown}
    for name, replicas in where.items():
        assert resident[name] == sorted(replicas), shown  # held where its requests went


def test_blind_routing_loads_adapters_everywhere(
    tiny_model: Path, allow_tmp: tuple[str, str], loras: list[Path]
) -> None:
    with _serve(tiny_model, allow_tmp, "blind") as blind:
        where = _placements(blind, loras)
        assert any(len(replicas) == 2 for replicas in where.values()), where
        assert eventually(lambda: _loads(blind) > len(loras), 30, "the loads reported")
