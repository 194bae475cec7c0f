"""The model's description is a typed contract (dpserve/contract/model_info.py): what the driver
builds is what the router decodes, a renamed or missing field is an error naming it,
and both sides check requests with the same limits."""

from __future__ import annotations

import asyncio
import logging
import time
from types import SimpleNamespace
from typing import Any, cast

import httpx
import msgspec
import pytest
import zmq.asyncio

from dpserve.contract import protocol as p
from dpserve.contract import validation as pv
from dpserve.contract.model_info import (
    CompileInfo,
    GangShape,
    ModelInfo,
    ModelInfoError,
    RankWeights,
    ReplicaFacts,
    decode,
    gathered,
)
from dpserve.router import deps
from dpserve.router.app import RouterSettings, create_app
from dpserve.router.pool import PoolSettings, ReplicaPool
from tests.stub_replica import FEATURES, StubReplica, model_info

torch = pytest.importorskip("torch")

from dpserve.worker.call_settings import CallSettings  # noqa: E402
from dpserve.worker.edit import EditSupport  # noqa: E402
from dpserve.worker.features import Features, VideoSupport  # noqa: E402
from dpserve.worker.step_cache import StepCaches  # noqa: E402

FAST = PoolSettings(ping_interval_s=0.05, ping_timeout_s=0.5, control_timeout_s=5)


def _facts(features: Features, **changes: Any) -> ReplicaFacts:
    """A replica's boot facts as boot.build_executor makes them."""
    fields: dict[str, Any] = {
        "replica": 3,
        "layout": "tp1-sp2(u2r1)-pp1-cfg1-dp1",
        "parallel": GangShape(tp=1, sp=2, ulysses=2, ring=1, cfg=1),
        "gang_size": 2,
        "threads_per_rank": 4,
        "device": "cuda",
        "dtype": "bfloat16",
        "size_factor": 16,
        "max_side": 1024,
        "max_steps": 50,
        "max_sequence_length": 512,
        "max_sessions": 8,
        "session_idle_timeout_s": 300.0,
        "compile": None,
        "realtime": "supported",
        "features": features.info(),
        "cfg_parallel": "off",
        "without_true_cfg": "whole",
    }
    return ReplicaFacts(**{**fields, **changes})


def _answer(facts: ReplicaFacts, rank: int = 0) -> ModelInfo:
    """One rank's model_info answer (ControlOps.op_model_info)."""
    weights = RankWeights(rank=rank, tp_rank=0, sp_rank=rank, cfg_rank=0, bytes={"vae": 10})
    return ModelInfo(
        **msgspec.structs.asdict(facts),
        model_path="/models/wan",
        pipeline_class="WanPipeline",
        components=["transformer", "vae"],
        released=False,
        loras=[],
        rank_weights=[weights],
        ranks=1,
    )


def _over_the_wire(info: ModelInfo) -> dict[str, Any]:
    """What the router's pool reads: the driver's ControlResult, encoded and decoded."""
    body = p.ControlResult(op="model_info", replica=info.replica, result=msgspec.to_builtins(info))
    message = p.decode(p.encode(p.RESULT, "r1", body))
    result: p.ControlResult = message.body_as(p.ControlResult)
    return result.result


VIDEO = VideoSupport(max_frames=81, frame_factor=4, default_frames=49, image_to_video=True)
WORKER = Features(
    EditSupport(edits=True, inpainting=False, max_images=2),
    partial_images=3,
    step_caches=StepCaches((), refusal="not under sequence parallel"),
    video=VIDEO,
    settings=CallSettings(text_length=512, text_multiple=2, shift_key="shift", vae_tiling=True),
)


def test_what_the_driver_builds_is_what_the_router_decodes() -> None:
    compiled = CompileInfo(sizes=["64x64"], warmup_graphs=1, other_shapes="eager")
    facts = _facts(WORKER, compile=compiled)
    sent = gathered([_answer(facts, 0), _answer(facts, 1)])
    raw = _over_the_wire(sent)
    assert decode(raw) == sent
    assert sent.ranks == 2 and [w.rank for w in sent.rank_weights] == [0, 1]
    # The wire form keeps the names clients see (GET /model_info, /v1/models).
    assert list(raw)[:3] == ["replica", "layout", "parallel"]
    assert raw["features"]["max_sequence_length"] == {"max": 512, "multiple_of": 2}
    assert raw["features"]["flow_shift"] == {"default": None}
    assert raw["features"]["step_caches_unavailable"] == "not under sequence parallel"
    assert raw["features"]["video"]["image_to_video"] is True
    assert raw["compile"] == {"sizes": ["64x64"], "warmup_graphs": 1, "other_shapes": "eager"}
    # The one optional field is left out while step caches are offered.
    offered = Features(EditSupport(False, False, 0), 0, step_caches=StepCaches(("taylorseer",)))
    shown = msgspec.to_builtins(offered.info())
    assert "step_caches_unavailable" not in shown
    assert shown["step_caches"] == {"taylorseer": {"interval": 3}}  # an int stays an int


def test_the_stub_replicas_answer_is_a_whole_model_info() -> None:
    assert msgspec.to_builtins(decode(model_info())) == model_info()


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda raw: raw.pop("size_factor"), "size_factor"),
        (lambda raw: raw["features"].pop("max_n"), "max_n"),
        (lambda raw: raw["features"].update(maxN=raw["features"].pop("max_n")), "max_n"),
        (lambda raw: raw["parallel"].update(sp="2"), "$.parallel.sp"),
        (lambda raw: raw.update(max_side=0), "$.max_side"),
        (lambda raw: raw["features"].update(video={"max_frames": 81}), "$.features.video"),
    ],
)
def test_a_renamed_missing_or_wrong_field_is_an_error_naming_it(change: Any, named: str) -> None:
    raw = model_info()
    change(raw)
    with pytest.raises(ModelInfoError, match=f"contract: .*{named.replace('$', '[$]')}"):
        decode(raw)


def test_a_newer_peers_extra_field_is_ignored() -> None:
    assert decode({**model_info(), "added_later": 1}) == decode(model_info())


def test_the_limits_from_one_description_are_the_same_on_both_sides() -> None:
    for features in (WORKER, Features(EditSupport(False, False, 0), 0)):
        facts = _facts(features)
        replica_side = facts.limits()  # what boot.open_driver gives the driver
        info = decode(_over_the_wire(_answer(facts)))
        pool = SimpleNamespace(serving=lambda info=info: [SimpleNamespace(info=info)])
        router_side = deps.limits(cast(ReplicaPool, pool))
        assert router_side == replica_side
        assert replica_side.sequence_split == 2 and replica_side.max_side == 1024
        assert replica_side.min_side == replica_side.size_factor == 16
        assert replica_side.max_steps == 50 and replica_side.max_n == pv.Limits.max_n
    video = _facts(WORKER).limits()
    assert (video.max_frames, video.frame_factor, video.default_frames) == (81, 4, 49)
    assert video.default_fps == VIDEO.default_fps
    assert facts.limits().max_frames == 0  # an image model makes no videos
    empty = SimpleNamespace(serving=lambda: [])
    assert deps.limits(cast(ReplicaPool, empty)) == pv.Limits()  # none has said yet


def test_a_replica_whose_model_info_does_not_decode_is_reported_not_served(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def scenario() -> None:
        ctx = zmq.asyncio.Context()
        stub = StubReplica(ctx, features={"max_n": "ten"})
        app = create_app(RouterSettings(workers=(stub.endpoint,), pool=FAST))
        try:
            async with app.router.lifespan_context(app):
                transport = httpx.ASGITransport(app=app)
                async with httpx.AsyncClient(
                    transport=transport, base_url="http://localhost"
                ) as http:
                    pool: ReplicaPool = app.state.running.pool
                    [replica] = pool.replicas.values()
                    deadline = time.monotonic() + 10
                    while not (replica.last_error or "").startswith("model_info does not"):
                        assert time.monotonic() < deadline, "model_info was never read"
                        await asyncio.sleep(0.02)
                    assert "$.features.max_n" in replica.last_error
                    assert not replica.serving and replica.info is None
                    assert (await http.get("/ready")).status_code == 503
                    models = (await http.get("/v1/models")).json()
                    assert models["data"][0]["features"] is None
                    [shown] = (await http.get("/health/replicas")).json()["replicas"]
                    assert shown["state"] != "serving"
                    assert "$.features.max_n" in shown["last_error"]
                    asked = stub.calls.count("model_info")
                    while stub.calls.count("model_info") < asked + 3:  # the error, logged once
                        assert time.monotonic() < deadline + 10, "no more pings came"
                        await asyncio.sleep(0.02)
        finally:
            await stub.close()
            ctx.term()

    with caplog.at_level(logging.ERROR, logger="dpserve"):
        asyncio.run(scenario())
    logged = [r for r in caplog.records if "cannot serve" in r.getMessage()]
    assert len(logged) == 1 and "max_n" in logged[0].getMessage()


def test_the_features_the_router_shows_are_the_ones_sent() -> None:
    sent = {**FEATURES, "step_caches_unavailable": "no"}
    info = decode({**model_info(), "features": sent})
    assert msgspec.to_builtins(info.features) == sent
