"""Per-request LoRA the way users reach it: `dpserve serve --dp-size 2` (real HTTP, the
router, two real workers with the tiny Flux model), adapters named in the request.

What only real processes show: the router resolves a registered name and sends the path
on, every replica loads and caches what requests name, the bytes equal the service-wide
``set_lora`` with the same adapter and strength, nothing stays on after the request, a
realtime session renders with its own adapters, and the cache's counts reach /metrics and
/v1/models.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.realtime_client import RealtimeSocket
from tests.servers import ServeProcess

pytestmark = [pytest.mark.e2e, pytest.mark.rest_lane]

BASE: dict[str, Any] = {"prompt": "a red fox", "size": "64x64", "num_inference_steps": 4, "seed": 5}


@pytest.fixture(scope="module")
def loras(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    from dpserve.worker.tiny_model import build_tiny_lora

    root = tmp_path_factory.mktemp("request-loras")
    return [build_tiny_lora(root / f"style-{i}", tiny_model, seed=10 + i) for i in range(3)]


@pytest.fixture(scope="module")
def served(
    tiny_model: Path, loras: list[Path], allow_tmp: tuple[str, str]
) -> Iterator[ServeProcess]:
    flags = ("--lora", f"ink={loras[0]}", "--lora-cache-mb", "64", *allow_tmp)
    with ServeProcess(tiny_model, 2, *flags) as running:
        yield running


def _image(served: ServeProcess, **fields: Any) -> bytes:
    answer = served.http.post("/v1/images/generations", json={**BASE, **fields})
    assert answer.status_code == 200, answer.text
    return base64.b64decode(answer.json()["data"][0]["b64_json"])


def _control(served: ServeProcess, route: str, **body: Any) -> None:
    answer = served.http.post(route, json=body)
    assert answer.status_code == 200, answer.text


def test_a_request_adapter_equals_set_lora_and_leaves_nothing_behind(
    served: ServeProcess, loras: list[Path]
) -> None:
    base = _image(served)
    wash = {"name": "wash", "path": str(loras[1]), "scale": 0.7}
    with_wash = _image(served, lora=wash)
    assert with_wash != base
    # Both replicas, each its first and its cached use: one result.
    assert {_image(served, lora=wash) for _ in range(3)} == {with_wash}
    assert _image(served) == base  # nothing stays on
    # A name sent with its path before, now without it (its scale: the request's own).
    assert _image(served, lora={"name": "wash", "scale": 0.7}) == with_wash
    assert _image(served, lora="wash") not in (with_wash, base)  # the name alone: scale 1
    assert _image(served, lora="ink") != base  # a registered name: the router adds its path
    stacked = _image(served, lora=[wash, {"name": "ink", "scale": 0.5}])
    assert stacked not in (with_wash, base)

    _control(served, "/v1/set_lora", lora_nickname="svc", lora_path=str(loras[1]), strength=0.7)
    try:
        assert _image(served) == with_wash  # the service's, at the same strength: same bytes
        assert _image(served, lora=[]) == base  # replaced for this request only
        assert _image(served) == with_wash
    finally:
        _control(served, "/v1/set_lora", lora_nickname="svc", strength=0.0)
    assert _image(served) == base


def test_bad_adapters_are_400s_that_say_what_to_fix(
    served: ServeProcess, tmp_path: Path, loras: list[Path]
) -> None:
    def refused(lora: Any, says: str) -> None:
        answer = served.http.post("/v1/images/generations", json={**BASE, "lora": lora})
        assert answer.status_code == 400, answer.text
        assert says in answer.text, answer.text

    refused("nobody", "nobody")
    refused({"name": "ink", "path": str(loras[2])}, str(loras[0]))  # a name has one path
    refused({"name": "far", "path": "/etc"}, "lora")  # outside the allowed folders
    refused({"name": "x", "scale": 99}, "between -10 and 10")
    assert _image(served) == _image(served, lora=[])  # and nothing changed


def test_edits_and_realtime_take_their_adapters(served: ServeProcess, loras: list[Path]) -> None:
    wash = {"name": "wash", "path": str(loras[1]), "scale": 0.7}
    generated = _image(served, lora=wash)
    with RealtimeSocket(served.url) as ws:
        ws.send(type="init", mode="step", lora=wash, **BASE)
        ws.expect("init_ack")
        frame = ws.expect("frame")
    assert frame["content"] == generated  # frame 0 is the generation, adapters included

    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (64, 64), (90, 120, 200)).save(buf, format="PNG")
    form = {"prompt": "a red fox", "num_inference_steps": "4", "seed": "5"}
    files = {"image": ("in.png", buf.getvalue(), "image/png")}

    def edit(**extra: str) -> bytes:
        answer = served.http.post("/v1/images/edits", data={**form, **extra}, files=files)
        assert answer.status_code == 200, answer.text
        return base64.b64decode(answer.json()["data"][0]["b64_json"])

    plain = edit()
    assert edit(lora='{"name": "wash", "scale": 0.7}') != plain
    assert edit(lora="ink") != plain
    assert edit() == plain


def test_the_cache_is_seen_in_metrics_and_models(served: ServeProcess, loras: list[Path]) -> None:
    _image(served, lora={"name": "wash", "path": str(loras[1]), "scale": 0.7})
    text = served.http.get("/metrics").text
    for name in ("hits", "misses", "loads", "evictions"):
        assert re.search(rf"^dpserve_lora_cache_{name}_total\{{", text, re.M), name
    loads = re.findall(r"^dpserve_lora_cache_loads_total\{[^}]*\} ([0-9.e+]+)$", text, re.M)
    assert sum(float(v) for v in loads) >= 1
    models = served.http.get("/v1/models").json()["data"][0]
    known = {a["name"]: a for a in models["adapters"]}
    assert known["wash"]["path"] == str(loras[1]) and known["wash"]["resident"]
    assert known["ink"]["path"] == str(loras[0])
