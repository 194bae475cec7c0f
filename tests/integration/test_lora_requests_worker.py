"""A request's own LoRA adapters on a real one-rank executor in process (the tiny Flux
model, real tiny adapters): the same bytes as ``set_lora``, nothing left behind, the
cache's evictions, and every bad adapter a 400 that changes nothing. Gangs (cfg, tp):
test_lora_requests_gang.py."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dpserve.config.worker import WorkerConfig
from dpserve.contract import protocol as p
from dpserve.contract.control_state import bad
from tests.executors import one_rank_executors, reply_to
from tests.workers import free_port

torch = pytest.importorskip("torch")

from safetensors.torch import load_file, save_file  # noqa: E402

from dpserve.worker.executor import Executor  # noqa: E402
from dpserve.worker.lora_cache import internal_name  # noqa: E402

BASE = dict(prompt="a red fox", width=64, height=64, num_inference_steps=3, seed=[5])
FILE = "pytorch_lora_weights.safetensors"


@pytest.fixture(scope="module")
def loras(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    from dpserve.worker.tiny_model import build_tiny_lora

    root = tmp_path_factory.mktemp("request-loras")
    return [build_tiny_lora(root / f"style-{i}", tiny_model, seed=20 + i) for i in range(4)]


@pytest.fixture(scope="module")
def executors(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Executor, Executor]]:
    """The executor under test, and a fresh one that only ever runs set_lora."""
    allow = (tmp_path_factory.getbasetemp(),)
    configs = [
        WorkerConfig(model=tiny_model, port=free_port(), device="cpu", allow_paths=allow)
        for _ in range(2)
    ]
    with one_rank_executors(configs, tmp_path_factory.mktemp("gang")) as built:
        yield built[0], built[1]


def _png(executor: Executor, *lora: p.LoraRef | None, **fields: Any) -> bytes:
    asked = None if lora == (None,) else list(lora)
    return reply_to(executor, {**BASE, "lora": asked, **fields}).blobs[0]


def _plain(executor: Executor) -> bytes:
    return reply_to(executor, BASE).blobs[0]


def _control(executor: Executor, op: str, **args: Any) -> dict[str, Any]:
    reply = p.decode(executor.control("c", p.ControlRequest(op=op, args=args), 0))
    if reply.kind == p.ERROR:
        raise p.decode_error(reply)
    result: dict[str, Any] = reply.body_as(p.ControlResult).result
    return result


def _refused(executor: Executor, *lora: p.LoraRef) -> p.RequestError:
    with pytest.raises(p.RequestError) as err:
        _png(executor, *lora)
    return err.value


def _held(executor: Executor) -> set[str]:
    return set(getattr(executor.pipe.transformer, "peft_config", {}) or {})


def _ref(name: str, path: Path | None = None, scale: float = 1.0) -> p.LoraRef:
    return p.LoraRef(name=name, path=None if path is None else str(path), scale=scale)


def test_request_adapters_equal_set_lora_and_leave_nothing_behind(
    executors: tuple[Executor, Executor], loras: list[Path]
) -> None:
    ex, fresh = executors
    base = _plain(fresh)
    assert _plain(ex) == base
    one = _png(ex, _ref("ink.v1", loras[0], 0.7))
    assert one != base
    assert _png(ex, _ref("ink.v1", scale=0.7)) == one  # the name alone, now cached
    assert _plain(ex) == base and _png(ex) == base  # nothing left on; [] is "none"
    stacked = _png(ex, _ref("ink.v1", scale=0.7), _ref("wash", loras[1], -0.4))
    assert stacked not in (one, base)
    assert _plain(ex) == base

    try:
        _control(fresh, "set_lora", lora_nickname="a", lora_path=str(loras[0]), strength=0.7)
        assert _plain(fresh) == one
        _control(
            fresh,
            "set_lora",
            lora_nickname=["a", "b"],
            lora_path=[str(loras[0]), str(loras[1])],
            strength=[0.7, -0.4],
        )
        assert _plain(fresh) == stacked
    finally:
        _control(fresh, "set_lora", lora_nickname="a", strength=0.0)
    report = ex.status.adapters
    assert report is not None and report.resident == ["ink.v1", "wash"]
    assert (report.hits, report.loads, report.failures) == (2, 2, 0)
    assert report.known["ink.v1"] == str(loras[0]) and report.load_s is not None


def test_the_service_adapters_come_back_after_a_request_and_merged_ones_are_kept(
    executors: tuple[Executor, Executor], loras: list[Path]
) -> None:
    ex, _ = executors
    base = _plain(ex)
    own = _png(ex, _ref("style2", loras[2], 0.5))
    _control(ex, "set_lora", lora_nickname="svc", lora_path=str(loras[2]), strength=0.5)
    try:
        assert _plain(ex) == own
        assert _png(ex) == base  # replaced for this request only
        assert _plain(ex) == own
        assert _png(ex, _ref("svc", scale=0.5)) == own  # a service nickname as a name
        assert "bound to" in str(_refused(ex, _ref("svc", loras[3])))
        _control(ex, "merge_lora_weights")
        merged = _plain(ex)
        conflict = _refused(ex, _ref("style2", scale=0.5))
        assert conflict.code == p.CONFLICT and "unmerge_lora_weights" in str(conflict)
        assert _png(ex, _ref("svc", scale=0.5)) == merged  # exactly the merged set is fine
        _control(ex, "unmerge_lora_weights")
        assert _plain(ex) == own
        assert ex.status.adapters is not None and ex.status.adapters.pinned == ["svc"]
    finally:
        # A weight update drops every adapter, the request ones with the service's.
        _control(ex, "update_weights_from_disk", model_path=str(ex.ops.applier.boot_path))
    assert _plain(ex) == base and _held(ex) == set()
    report = ex.status.adapters
    assert report is not None and report.resident == [] and "style2" in report.known
    assert _png(ex, _ref("style2", scale=0.5)) == own  # reloaded from its bound path


def test_least_recently_used_adapters_are_evicted_by_bytes(
    executors: tuple[Executor, Executor], loras: list[Path]
) -> None:
    ex, _ = executors
    cache = ex.adapters.cache
    size = (loras[0] / FILE).stat().st_size
    capacity = cache.capacity
    cache.capacity = 2 * size + size // 2  # room for two
    try:
        first = _png(ex, _ref("e0", loras[0]))
        _png(ex, _ref("e1", loras[1]))
        assert _png(ex, _ref("e0")) == first  # a hit: e1 is now the least recent
        evictions = cache.evictions  # the earlier tests' adapters went to make room
        _png(ex, _ref("e2", loras[2]))
        assert cache.evictions == evictions + 1 and list(cache.entries) == ["e0", "e2"]
        names = {internal_name(n) for n in ("e0", "e2")}
        assert {n for n in _held(ex) if n.startswith("req~e")} == names
        # Three in use at once stay, over the bound, for that request.
        _png(ex, _ref("e0"), _ref("e1"), _ref("e2"))
        assert {"e0", "e1", "e2"} <= set(cache.entries)
        assert _png(ex, _ref("e0")) == first
        assert cache.used <= cache.capacity
    finally:
        cache.capacity = capacity


def test_the_calibration_leaves_adapter_loads_and_evictions_out(
    executors: tuple[Executor, Executor], loras: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The router adds the load where a replica lacks a request's adapters, so the
    replica's seconds per unit must not hold it too (a churning cache would look like a
    slow replica). Loads and evictions made slow on purpose: the reply's inference time
    has them, the calibration's sample does not."""
    ex, _ = executors
    adapters, cache = ex.adapters, ex.adapters.cache
    load, delete = adapters._load_into_transformer, adapters._delete
    monkeypatch.setattr(adapters, "_load_into_transformer", lambda *a: _after(1.0, load, *a))
    monkeypatch.setattr(adapters, "_delete", lambda *a: _after(1.0, delete, *a))
    samples: list[float] = []
    observe = ex.status.calibration.observe
    monkeypatch.setattr(
        ex.status.calibration, "observe", lambda u, s: (samples.append(s), observe(u, s))
    )
    size = (loras[0] / FILE).stat().st_size
    monkeypatch.setattr(cache, "capacity", size + size // 2)  # room for one
    _png(ex, _ref("c0", loras[0]))
    hit = _reply_s(ex, _ref("c0"))
    evictions = cache.evictions
    missed = _reply_s(ex, _ref("c1", loras[1]))  # loads c1, evicts c0
    assert cache.evictions == evictions + 1
    assert missed >= 2.0 > hit
    # The same request's run either way: well within the 1 s an eviction alone takes.
    sample_hit, sample_miss = samples[-2:]
    assert abs(sample_miss - sample_hit) < 0.5, (sample_hit, sample_miss)


def _after(seconds: float, call: Any, *args: Any) -> Any:
    time.sleep(seconds)  # a slow disk's load, not a wait for a condition
    return call(*args)


def _reply_s(executor: Executor, *lora: p.LoraRef) -> float:
    reply = reply_to(executor, {**BASE, "lora": list(lora)})
    return reply.body_as(p.GenerateResult).inference_time_s


def _broken(root: Path, name: str, good: Path, change: Any) -> Path:
    tensors = load_file(str(good / FILE))
    folder = root / name
    folder.mkdir()
    save_file(change(tensors), str(folder / FILE))
    return folder


def test_bad_adapters_are_400s_that_change_nothing(
    executors: tuple[Executor, Executor],
    loras: list[Path],
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    ex, _ = executors
    before = _png(ex, _ref("kept", loras[3]))
    base = _plain(ex)
    held, known = _held(ex), dict(ex.adapters.cache.known)
    root = tmp_path_factory.mktemp("bad-loras")
    key = "transformer.single_transformer_blocks.0.attn.to_q.lora_A.weight"

    def wider(t: dict[str, Any]) -> dict[str, Any]:
        return {**t, key: torch.ones(4, 48)}

    def elsewhere(t: dict[str, Any]) -> dict[str, Any]:
        return {k.replace("single_transformer_blocks", "no_such_block"): v for k, v in t.items()}

    def norm(t: dict[str, Any]) -> dict[str, Any]:
        return {**t, "transformer.single_transformer_blocks.0.attn.norm_q.weight": torch.ones(8)}

    def text(t: dict[str, Any]) -> dict[str, Any]:
        return {**t, "text_encoder.text_model.x.lora_A.weight": torch.ones(4, 4)}

    pickled = root / "pickled"
    pickled.mkdir()
    (pickled / "pytorch_lora_weights.bin").write_bytes(b"not read")
    outside = tmp_path.parent.parent.parent / "nowhere"  # not a folder the replica allows
    cases = {
        "wider": (_broken(root, "wider", loras[0], wider), "48 input features, the layer has 32"),
        "elsewhere": (_broken(root, "elsewhere", loras[0], elsewhere), "no_such_block"),
        "norm": (_broken(root, "norm", loras[0], norm), "own weights"),
        "text": (_broken(root, "text", loras[0], text), "transformer only"),
        "pickled": (pickled, "pickle"),
        "outside": (outside, "not an allowed folder"),
    }
    for name, (folder, says) in cases.items():
        err = _refused(ex, _ref(name, folder))
        assert err.code == p.INVALID_REQUEST and err.fields[0].field == "lora", name
        assert says in str(err) and repr(name) in str(err), (name, str(err))
    unknown = _refused(ex, _ref("nobody"))
    assert "'nobody' is unknown" in str(unknown)
    other = _refused(ex, _ref("kept", loras[2]))
    assert str(loras[3]) in str(other) and str(loras[2]) in str(other)
    cache = ex.adapters.cache
    capacity, cache.capacity = cache.capacity, 100
    try:
        assert "more than this replica's whole adapter cache" in str(
            _refused(ex, _ref("big", loras[1]))
        )
    finally:
        cache.capacity = capacity
    assert _held(ex) == held and ex.adapters.cache.known == known
    assert _plain(ex) == base and _png(ex, _ref("kept")) == before


def test_a_refusal_by_another_rank_drops_what_this_rank_loaded(
    executors: tuple[Executor, Executor], loras: list[Path]
) -> None:
    """The gang's agreement as this rank sees it: its load worked, a peer's did not."""
    ex, _ = executors
    base = _plain(ex)
    failures = ex.adapters.cache.failures
    peer = bad("lora", "adapter 'peer' could not be loaded as a LoRA: rank 1 ran out")
    refs = [_ref("peer", loras[1])]
    with pytest.raises(p.RequestError) as err, ex.adapters.applied(refs, lambda m: m or peer):
        raise AssertionError("the call ran")
    assert "rank 1 ran out" in str(err.value)
    assert internal_name("peer") not in _held(ex) and "peer" not in ex.adapters.cache.known
    assert ex.adapters.cache.failures == failures + 1
    assert _plain(ex) == base


def test_a_realtime_session_keeps_its_adapters_on_every_frame(
    executors: tuple[Executor, Executor], loras: list[Path]
) -> None:
    from dpserve.contract import realtime as rt

    ex, _ = executors
    base = _plain(ex)
    wash = _ref("rt-wash", loras[1], 0.6)
    frames: dict[str, list[bytes]] = {}
    for sid, lora in (("with", [wash]), ("without", None)):
        params = rt.SessionParams(
            prompt="a red fox", width=64, height=64, num_inference_steps=3, seed=5, lora=lora
        )
        got = []
        for request in (
            rt.SessionRequest(action=rt.OPEN, session_id=sid, params=params),
            rt.SessionRequest(action=rt.STEP, session_id=sid, prompt="a red fox at night"),
        ):
            reply = p.decode(ex.session("s", request, []))
            assert reply.kind == p.RESULT, reply.body
            got.append(reply.blobs[0])
            assert _plain(ex) == base  # between frames: nothing left on
        ex.session("s", rt.SessionRequest(action=rt.CLOSE, session_id=sid), [])
        frames[sid] = got
    assert frames["with"][0] == _png(ex, wash)  # frame 0 is the generation, adapters included
    assert all(a != b for a, b in zip(frames["with"], frames["without"], strict=True))


def test_an_edit_takes_its_adapters(
    executors: tuple[Executor, Executor], loras: list[Path]
) -> None:
    import io

    from PIL import Image

    ex, _ = executors
    buf = io.BytesIO()
    Image.new("RGB", (64, 64), (90, 120, 200)).save(buf, format="PNG")
    edit = {"edit": p.EditInput(images=[0], strength=0.75)}

    def edited(lora: list[p.LoraRef] | None) -> bytes:
        return reply_to(ex, {**BASE, **edit, "lora": lora}, [buf.getvalue()]).blobs[0]

    plain = edited(None)
    wash = [_ref("edit-wash", loras[1], 0.7)]
    with_wash = edited(wash)
    assert with_wash != plain and edited(None) == plain and edited(wash) == with_wash
