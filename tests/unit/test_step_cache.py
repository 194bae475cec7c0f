"""The step_cache field and flags: their shapes, the replica's offer, and the refusals."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from dpserve.config.worker import StepCacheKind, compile_size
from dpserve.contract import protocol as p
from dpserve.contract import validation as pv
from dpserve.worker import compile as comp
from dpserve.worker.edit import EditSupport
from dpserve.worker.features import Features
from dpserve.worker.step_cache import StepCaches, refusal, service_default

FBC = "first_block_cache"
BOTH = StepCaches(("first_block_cache", "taylorseer"))


def _parse(step_cache: Any) -> p.StepCache | None:
    return pv.parse_generate({"prompt": "x", "step_cache": step_cache}, pv.Limits()).step_cache


def test_the_config_spells_the_protocols_kinds() -> None:
    from typing import get_args

    assert set(get_args(StepCacheKind)) == set(pv.STEP_CACHE_KNOBS)


@pytest.mark.parametrize(
    ("field", "parsed"),
    [
        ("none", p.StepCache(type="none")),
        ("first_block_cache", p.StepCache(type="first_block_cache")),
        ({"type": "first_block_cache", "threshold": 0.2}, p.StepCache(type=FBC, threshold=0.2)),
        ({"type": "taylorseer", "interval": 4}, p.StepCache(type="taylorseer", interval=4)),
        ({"type": "taylorseer"}, p.StepCache(type="taylorseer")),
    ],
)
def test_a_name_or_an_object_with_the_kinds_knob(field: Any, parsed: p.StepCache) -> None:
    assert _parse(field) == parsed


@pytest.mark.parametrize(
    ("field", "says"),
    [
        ("teacache", "first_block_cache, taylorseer, none"),
        ({"type": ["x"]}, "a name or"),
        (3, "a name or"),
        ({"type": "taylorseer", "threshold": 0.1}, "taylorseer takes only interval, not threshold"),
        ({"type": "none", "threshold": 0.1}, "none takes no settings"),
        ({"type": "first_block_cache", "threshold": 2}, "threshold must be a number in [0, 1]"),
        ({"type": "first_block_cache", "threshold": True}, "threshold must be a number"),
        ({"type": "taylorseer", "interval": 2.5}, "interval must be an integer in [2, 50]"),
        ({"type": "taylorseer", "interval": 1}, "interval must be an integer in [2, 50]"),
    ],
)
def test_a_bad_step_cache_is_a_400_naming_the_field(field: Any, says: str) -> None:
    with pytest.raises(p.RequestError) as err:
        _parse(field)
    assert err.value.code == p.INVALID_REQUEST
    assert [e.field for e in err.value.fields] == ["step_cache"]
    assert says in err.value.fields[0].message


def test_the_request_wins_over_the_service_default_and_knobs_are_filled() -> None:
    service = StepCaches(BOTH.offered, default=p.StepCache(type="taylorseer", interval=5))
    assert service.resolve(None) == p.StepCache(type="taylorseer", interval=5)
    assert service.resolve(p.StepCache(type="none")) is None
    asked = service.resolve(p.StepCache(type="first_block_cache"))
    assert asked == p.StepCache(type="first_block_cache", threshold=0.08)
    assert BOTH.resolve(None) is None


def test_a_kind_the_replica_does_not_offer_is_refused_naming_field_and_offer() -> None:
    offer = StepCaches(("taylorseer",))
    offer.check(p.StepCache(type="taylorseer"))
    offer.check(p.StepCache(type="none"))
    with pytest.raises(p.RequestError) as err:
        offer.check(p.StepCache(type="first_block_cache"))
    assert err.value.code == p.UNSUPPORTED
    assert err.value.fields == [p.FieldError("step_cache", "must be one of: taylorseer, or none")]
    refused = StepCaches((), refusal="not under tensor or sequence parallel")
    with pytest.raises(p.RequestError, match="not under tensor or sequence parallel"):
        refused.check(p.StepCache(type="taylorseer"))
    features = Features(EditSupport(False, False, 0), 0, step_caches=refused).info()
    assert {k: v for k, v in msgspec.to_builtins(features).items() if "step_cache" in k} == {
        "step_caches": {},
        "step_cache_default": None,
        "step_caches_unavailable": "not under tensor or sequence parallel",
    }


def test_the_service_flags_make_its_default_or_name_what_is_wrong() -> None:
    assert service_default(None, None, None) is None
    fbc = service_default("first_block_cache", 0.3, None)
    assert fbc == p.StepCache(type="first_block_cache", threshold=0.3)
    with pytest.raises(ValueError, match="--step-cache-interval needs --step-cache"):
        service_default(None, None, 3)
    with pytest.raises(ValueError, match="first_block_cache takes only threshold"):
        service_default("first_block_cache", None, 3)
    with pytest.raises(ValueError, match=r"threshold must be a number in \[0, 1\]"):
        service_default("first_block_cache", 1.5, None)


def test_layouts_and_compile_that_refuse_step_caches_and_compile() -> None:
    assert refusal(1, 1, compiled=False) is None
    assert "tp=2, sp=1" in str(refusal(2, 1, compiled=False))
    assert "tp=1, sp=2" in str(refusal(1, 2, compiled=False))
    assert "--compile" in str(refusal(1, 1, compiled=True))
    assert comp.refusal(1, 1, None) is None
    assert "sequence parallel (tp=1, sp=2)" in str(comp.refusal(1, 2, None))
    assert "do not combine" in str(comp.refusal(1, 1, "taylorseer"))


def test_compile_sizes_default_to_the_pipelines_and_must_be_requestable() -> None:
    assert comp.compile_sizes((), (1024, 1024), 16, 2048) == ((1024, 1024),)
    given = ("512x512", "768x512", "512x512")
    assert comp.compile_sizes(given, (1024, 1024), 16, 2048) == ((512, 512), (768, 512))
    with pytest.raises(ValueError, match="multiples of 16"):
        comp.compile_sizes(("520x512",), (1024, 1024), 16, 2048)
    with pytest.raises(ValueError, match="at most --max-side 1024"):
        comp.compile_sizes(("2048x512",), (1024, 1024), 16, 1024)
    with pytest.raises(ValueError, match="at most 8"):
        comp.compile_sizes(tuple(f"{16 * i}x16" for i in range(1, 10)), (16, 16), 16, 2048)
    assert compile_size("0512x64") == "512x64"
    for bad in ("512", "512x", "0x64", "ax1", "-1x5"):
        with pytest.raises(Exception, match="must look like"):
            compile_size(bad)
