"""A request's ``lora`` as every parser reads it: generations, video jobs and realtime
``init`` take the same forms and name every bad adapter in one 400."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from dpserve.contract import protocol as p
from dpserve.contract import realtime as rt
from dpserve.contract import validation as pv
from dpserve.contract import video

LIMITS = pv.Limits()


def _parse(lora: Any) -> list[p.LoraRef] | None:
    return pv.parse_generate({"prompt": "x", "lora": lora}, LIMITS).lora


@pytest.mark.parametrize(
    ("given", "parsed"),
    [
        (None, None),
        ([], []),
        ("ink", [p.LoraRef(name="ink")]),
        (
            {"name": "ink", "path": "/m/ink", "scale": 0.5},
            [p.LoraRef(name="ink", path="/m/ink", scale=0.5)],
        ),
        ({"name": "ink", "path": None, "scale": None}, [p.LoraRef(name="ink")]),
        (
            [{"name": "a.b_c-1", "scale": 2}, "wash"],
            [p.LoraRef(name="a.b_c-1", scale=2.0), p.LoraRef(name="wash")],
        ),
    ],
)
def test_the_forms_a_request_gives(given: Any, parsed: list[p.LoraRef] | None) -> None:
    assert _parse(given) == parsed


@pytest.mark.parametrize(
    ("given", "says"),
    [
        (7, 'must be {"name"'),
        ({"name": "ink", "weight": 1}, "takes name, path and scale, not weight"),
        ({"path": "/m/ink"}, "name (and path, where given) must be strings"),
        ({"name": "ink", "scale": "high"}, "scale must be a number, got str"),
        ({"name": "ink", "scale": True}, "scale must be a number, got bool"),
        ({"name": "ink", "scale": 11}, "ink's scale must be between -10 and 10"),
        ({"name": "../ink"}, "must be 1-64 letters"),
        ({"name": "x" * 65}, "must be 1-64 letters"),
        ({"name": "ink", "path": ""}, "ink's path must be 1 to 4096 characters"),
        (["ink", {"name": "ink"}], "names an adapter twice"),
        ([f"a{i}" for i in range(pv.MAX_REQUEST_LORAS + 1)], "takes at most 8 adapters, got 9"),
    ],
)
def test_every_bad_adapter_is_named(given: Any, says: str) -> None:
    with pytest.raises(p.RequestError) as caught:
        _parse(given)
    assert caught.value.code == p.INVALID_REQUEST
    assert says in str(caught.value)
    assert all(f.field.startswith("lora") for f in caught.value.fields)


def test_a_video_job_carries_its_adapters_and_the_replica_checks_them_again() -> None:
    limits = pv.Limits(max_frames=33)
    params = video.parse_video({"prompt": "x", "lora": {"name": "ink", "scale": 0.7}}, limits)
    assert params.lora == [p.LoraRef(name="ink", scale=0.7)]
    assert video.check_job(params, limits).lora == params.lora
    bad = msgspec.structs.replace(params, lora=[p.LoraRef(name="ink", scale=50.0)])
    with pytest.raises(p.RequestError, match="ink's scale"):
        video.check_job(bad, limits)


def test_a_realtime_init_carries_its_adapters() -> None:
    def init(lora: Any) -> rt.ClientInit:
        raw = msgspec.msgpack.encode({"type": "init", "prompt": "x", "lora": lora})
        message = rt.decode_client(raw)
        assert isinstance(message, rt.InitMessage)
        return rt.parse_init(message, LIMITS)

    assert init("ink").params.lora == [p.LoraRef(name="ink")]
    assert init({"name": "ink", "scale": 0.5}).params.lora == [p.LoraRef(name="ink", scale=0.5)]
    assert init([{"name": "a"}, {"name": "b", "path": "/m/b"}]).params.lora == [
        p.LoraRef(name="a"),
        p.LoraRef(name="b", path="/m/b"),
    ]
    with pytest.raises(p.RequestError, match="names an adapter twice"):
        init(["a", "a"])
    with pytest.raises(rt.Malformed):
        init({"name": "a", "weight": 2})  # an unknown key is refused by the typed decoder
    params = init("ink").params
    with pytest.raises(p.RequestError, match="must be 1-64 letters"):
        rt.check_session(msgspec.structs.replace(params, lora=[p.LoraRef(name="-x")]), LIMITS)
