"""Which path an adapter name stands for (dpserve/router/lora_names.py): the sources in
their order, a name bound to one path, names learned only from answered requests and
boundedly. Through HTTP with replicas' own names: tests/unit/test_router_lora.py."""

from __future__ import annotations

import pytest
import zmq.asyncio

from dpserve.contract import protocol as p
from dpserve.contract.control_state import ControlState, StateDoc
from dpserve.router.lora_names import REGISTERED, SENT, SERVICE, KnownAdapter, LoraNames
from dpserve.router.membership import Membership


@pytest.fixture
def members() -> Membership:
    return Membership(zmq.asyncio.Context(), None, 1.0)  # no replicas


def _service(**loras: str) -> StateDoc:
    return StateDoc().successor("set_lora", ControlState(loras=dict(loras)))


def _refs(*pairs: tuple[str, str | None]) -> list[p.LoraRef]:
    return [p.LoraRef(name=n, path=path) for n, path in pairs]


def test_the_first_source_that_knows_a_name_gives_its_path(members: Membership) -> None:
    names = LoraNames({"ink": "/reg/ink"}, members, lambda: _service(ink="/svc/ink", svc="/s"))
    names.learn(_refs(("ink", "/sent/ink"), ("new", "/sent/new")))
    assert names.find("ink") == KnownAdapter("ink", "/reg/ink", REGISTERED)
    assert names.find("svc") == KnownAdapter("svc", "/s", SERVICE)
    assert names.find("new") == KnownAdapter("new", "/sent/new", SENT)
    assert names.find("nobody") is None
    assert [a.name for a in names.known()] == ["ink", "new", "svc"]
    resolved = names.resolve_refs(_refs(("ink", None), ("svc", "/s"), ("other", "/o")))
    assert resolved == _refs(("ink", "/reg/ink"), ("svc", "/s"), ("other", "/o"))
    assert names.resolve_refs(None) is None and names.resolve_refs([]) == []


def test_every_bad_name_is_named_in_one_400(members: Membership) -> None:
    names = LoraNames({"ink": "/reg/ink"}, members, lambda: None)
    with pytest.raises(p.RequestError) as refused:
        names.resolve_refs(_refs(("nobody", None), ("ink", "/elsewhere")))
    assert refused.value.code == p.INVALID_REQUEST
    fields = [(f.field, f.message) for f in refused.value.fields or []]
    assert [f for f, _ in fields] == ["lora", "lora"]
    assert "'nobody' is not known" in fields[0][1] and "--lora nobody=PATH" in fields[0][1]
    assert "/reg/ink" in fields[1][1] and "/elsewhere" in fields[1][1]


def test_while_merged_a_requests_own_adapters_are_a_409(members: Membership) -> None:
    merged = StateDoc().successor("merge", ControlState(loras={"s": "/s"}, merged=1.0))
    names = LoraNames({}, members, lambda: merged)
    with pytest.raises(p.RequestError) as refused:
        names.resolve_refs([])
    assert refused.value.code == p.CONFLICT
    assert names.resolve_refs(None) is None  # the service's own: served merged


def test_learned_names_are_bounded_oldest_out(members: Membership) -> None:
    names = LoraNames({}, members, lambda: None, max_sent=3)
    for i in range(5):
        names.learn(_refs((f"a{i}", f"/p{i}")))
    assert [a.name for a in names.known()] == ["a2", "a3", "a4"]
    names.learn(_refs(("a4", "/other"), ("bare", None)))  # known, or no path: nothing new
    assert names.find("a4") == KnownAdapter("a4", "/p4", SENT) and names.find("bare") is None
