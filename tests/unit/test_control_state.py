"""The control state: ops as changes to one small state, documents ordered by version."""

from __future__ import annotations

import pytest

from dpserve.contract.control_state import (
    ControlState,
    StateDoc,
    WeightSource,
    answer,
    newest,
    parse_doc,
    reduce,
    refusal,
    stored_after,
)
from dpserve.contract.protocol import (
    SYNC_STATE,
    RequestError,
)

LORA = {"lora_nickname": "a", "lora_path": "/l/a"}


def _after(*ops: tuple[str, dict[str, object]]) -> ControlState:
    state = ControlState()
    for revision, (op, args) in enumerate(ops, start=1):
        state = reduce(state, op, args, revision)
    return state


def test_lora_ops_build_the_adapter_state() -> None:
    state = _after(
        ("set_lora", LORA),
        ("set_lora", {"lora_nickname": "b", "lora_path": "/l/b"}),
        ("set_lora", {"lora_nickname": ["a", "b"], "strength": 0.5}),
    )
    assert state.loras == {"a": "/l/a", "b": "/l/b"}
    assert state.active == {"a": 0.5, "b": 0.5}
    merged = reduce(state, "merge_lora_weights", {"strength": 0.8}, 4)
    assert merged.merged == 0.8
    assert reduce(merged, "unmerge_lora_weights", {}, 5) == state
    assert answer("set_lora", {}, state)["active"][1] == {"nickname": "b", "strength": 0.5}


def test_a_weight_update_drops_adapters_and_asking_again_is_a_new_state() -> None:
    with_lora = _after(("set_lora", LORA))
    once = reduce(with_lora, "update_weights_from_disk", {"model_path": "/m"}, 7)
    # Every denoiser by default (Wan 2.2's second expert too; a replica without one
    # has none to reload).
    source = WeightSource("/m", 7)
    assert once == ControlState(weights={"transformer": source, "transformer_2": source})
    # The same folder again (its files rewritten): a different state, so it reloads.
    again = reduce(once, "update_weights_from_disk", {"model_path": "/m"}, 8)
    assert again != once and again.digest() != once.digest()


def test_memory_ops_are_idempotent_and_released_refuses_weight_changes() -> None:
    released = _after(("release_memory_occupation", {}))
    assert reduce(released, "release_memory_occupation", {}, 2) == released
    with pytest.raises(RequestError) as err:
        reduce(released, "set_lora", LORA, 2)
    assert err.value.status == 503 and "resume_memory_occupation" in str(err.value)
    assert reduce(released, "resume_memory_occupation", {}, 2) == ControlState()


@pytest.mark.parametrize(
    ("op", "args", "field"),
    [
        ("set_lora", {"lora_nickname": "a"}, "lora_path"),
        ("set_lora", {"lora_nickname": []}, "lora_nickname"),
        ("set_lora", {**LORA, "strength": [1, 2]}, "strength"),
        ("set_lora", {**LORA, "target": "vae"}, "target"),
        ("set_lora", {**LORA, "target": "transformer"}, "target"),
        ("merge_lora_weights", {}, "lora_nickname"),
        ("unmerge_lora_weights", {}, "lora_nickname"),
        ("update_weights_from_disk", {"model_path": 3}, "model_path"),
        ("update_weights_from_disk", {"model_path": "/m", "modules": []}, "modules"),
    ],
)
def test_refusals_name_the_field(op: str, args: dict[str, object], field: str) -> None:
    with pytest.raises(RequestError) as err:
        reduce(ControlState(), op, args, 1)
    assert err.value.status == 400 and err.value.fields[0].field == field


def test_an_adapter_for_wan_s_second_expert_is_refused_saying_what_to_do() -> None:
    with pytest.raises(RequestError, match=r"update_weights_from_disk \(modules: \[transformer_2"):
        reduce(ControlState(), "set_lora", {**LORA, "target": "transformer_2"}, 1)


def test_merged_adapters_must_be_unmerged_before_they_change() -> None:
    merged = reduce(_after(("set_lora", LORA)), "merge_lora_weights", {}, 2)
    with pytest.raises(RequestError, match="unmerge first"):
        reduce(merged, "set_lora", LORA, 3)


def test_documents_order_by_version_then_id_and_round_trip() -> None:
    boot = StateDoc()
    a = boot.successor("set_lora", _after(("set_lora", LORA)))
    b = boot.successor("release_memory_occupation", ControlState(released=True))
    assert a.version == b.version == 1 and a.id != b.id
    assert newest(boot, a, None, b) == max(a, b, key=lambda d: d.key)
    assert newest(None) is None
    assert parse_doc(a.to_builtins()) == a
    for bad in ({"version": "x"}, [], {"state": {"loras": 3}}):
        with pytest.raises(ValueError):
            parse_doc(bad)


def test_an_op_replaces_only_a_document_it_was_made_knowing() -> None:
    boot = StateDoc()
    mine = boot.successor("set_lora", _after(("set_lora", LORA)))
    other = {"lora_nickname": "b", "lora_path": "/l/b"}
    theirs = boot.successor("set_lora", _after(("set_lora", other)))
    # Two routers built on the same state: neither undoes the other, whatever the ids.
    assert not mine.knows(theirs) and not theirs.knows(mine)
    assert "another router changed the state" in str(refusal(theirs, mine, "set_lora"))
    assert stored_after(theirs, mine) is theirs
    # Built again on top of theirs, and over my first try: it replaces both.
    again = newest(theirs, mine)
    assert again is not None
    on_top = again.successor("set_lora", reduce(theirs.state, "set_lora", LORA, 2))
    assert on_top.state.loras == {"a": "/l/a", "b": "/l/b"}
    assert on_top.version == 2 and on_top.knows(theirs) and on_top.knows(mine)
    assert refusal(theirs, on_top, "set_lora") is None
    assert refusal(mine, on_top, "set_lora") is None and refusal(on_top, on_top, "set_lora") is None
    assert stored_after(theirs, on_top) is on_top and stored_after(None, mine) is mine
    # A replica behind (missed ops, restarted) takes it; a sync only moves forward.
    assert refusal(boot, on_top, "set_lora") is None
    assert refusal(on_top, mine, SYNC_STATE) is not None
    assert refusal(mine, on_top, SYNC_STATE) is None
    assert parse_doc(on_top.to_builtins()).base == again.key


def test_digest_is_stable_and_order_free() -> None:
    one = ControlState(loras={"a": "/a", "b": "/b"}, active={"a": 1.0})
    other = ControlState(loras={"b": "/b", "a": "/a"}, active={"a": 1.0})
    assert one.digest() == other.digest() and len(one.digest()) == 16
    assert ControlState().digest() != one.digest()
