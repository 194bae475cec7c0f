"""The wire contract: round trips, field validation, and a decoder no input can crash."""

from __future__ import annotations

import contextlib
import random

import msgspec
import pytest

from dpserve.contract import protocol as p
from dpserve.contract import validation as pv

LIMITS = pv.Limits(size_factor=16, min_side=16, max_side=1024, max_steps=50)


def test_round_trip_keeps_header_body_and_blobs() -> None:
    body = p.GenerateResult(
        images=[p.ImageMeta(index=0, blob=0, seed=5, format="png", width=64, height=32)],
        replica=3,
        inference_time_s=0.5,
        queue_time_s=0.01,
        peak_memory_mb=12.5,
    )
    frames = p.encode(p.RESULT, "req-1", body, [b"\x89PNG...", b"\x00\xff"])
    message = p.decode(frames)
    assert (message.id, message.kind) == ("req-1", p.RESULT)
    assert message.blobs == (b"\x89PNG...", b"\x00\xff")
    assert message.body_as(p.GenerateResult) == body


def test_no_pickle_on_the_wire() -> None:
    frames = p.encode(p.CONTROL, "x", p.ControlRequest(op="model_info", args={"a": [1, "b"]}))
    assert all(b"\x80\x04" not in f[:2] for f in frames)  # no pickle protocol marker
    assert msgspec.msgpack.decode(frames[0])["kind"] == p.CONTROL


def test_error_round_trip() -> None:
    error = p.RequestError(p.INVALID_REQUEST, "bad", [p.FieldError("width", "too big")])
    decoded = p.decode_error(p.decode(p.encode_error("id", error)))
    assert decoded.code == p.INVALID_REQUEST and decoded.status == 400
    assert decoded.fields == [p.FieldError("width", "too big")]


def test_valid_request_with_defaults_and_seed_expansion() -> None:
    params = pv.parse_generate({"prompt": "a cat", "n": 3, "seed": 10, "size": "64x32"}, LIMITS)
    assert params.seed == [10, 11, 12]
    assert (params.width, params.height) == (64, 32)
    assert params.num_inference_steps is None and params.output_format == "png"
    listed = pv.parse_generate({"prompt": "a", "n": 2, "seed": [4, 4]}, LIMITS)
    assert listed.seed == [4, 4]


@pytest.mark.parametrize(
    ("body", "fields"),
    [
        ({}, {"prompt"}),
        ({"prompt": 1}, {"prompt"}),
        ({"prompt": "x", "n": 0}, {"n"}),
        ({"prompt": "x", "n": 11}, {"n"}),
        ({"prompt": "x", "n": True}, {"n"}),
        ({"prompt": "x", "width": 20}, {"width"}),
        ({"prompt": "x", "height": 2048}, {"height"}),
        ({"prompt": "x", "num_inference_steps": 51}, {"num_inference_steps"}),
        ({"prompt": "x", "guidance_scale": "high"}, {"guidance_scale"}),
        ({"prompt": "x", "true_cfg_scale": -1}, {"true_cfg_scale"}),
        ({"prompt": "x", "seed": -1}, {"seed"}),
        ({"prompt": "x", "seed": [1, 2], "n": 3}, {"seed"}),
        ({"prompt": "x", "seed": "7"}, {"seed"}),
        ({"prompt": "x", "size": "big"}, {"size"}),
        ({"prompt": "x", "size": "64x64", "width": 64}, {"size"}),
        ({"prompt": "x", "size": "70x64"}, {"size"}),
        ({"prompt": "x", "output_format": "gif"}, {"output_format"}),
        ({"prompt": "x", "colour": "red"}, {"colour"}),
        ({"prompt": None, "n": 0, "width": 7, "seed": []}, {"prompt", "n", "width", "seed"}),
    ],
)
def test_each_bad_field_is_named(body: dict[str, object], fields: set[str]) -> None:
    with pytest.raises(p.RequestError) as err:
        pv.parse_generate(body, LIMITS)
    assert err.value.code == p.INVALID_REQUEST
    assert {f.field for f in err.value.fields} == fields
    for name in fields:
        assert name in str(err.value)


def test_non_object_body_is_refused() -> None:
    with pytest.raises(p.RequestError):
        pv.parse_generate([1, 2], LIMITS)


def test_unknown_control_op_is_refused() -> None:
    with pytest.raises(p.RequestError) as err:
        pv.parse_control(p.ControlRequest(op="format_disk"))
    assert err.value.code == p.UNSUPPORTED
    assert pv.parse_control(p.ControlRequest(op="set_lora")).op == "set_lora"
    assert p.MUTATING_OPS.isdisjoint(p.READ_ONLY_OPS)


def test_version_mismatch_keeps_the_request_id() -> None:
    header = msgspec.msgpack.encode({"v": 2, "id": "abc", "kind": "ping"})
    with pytest.raises(p.ProtocolError) as err:
        p.decode([header])
    assert err.value.request_id == "abc"


def _decode_only_protocol_errors(frames: list[bytes]) -> None:
    try:
        message = p.decode(frames)
        message.body_as(p.ControlRequest)
    except p.ProtocolError:
        pass


def test_fuzz_random_frames_never_crash_the_decoder() -> None:
    rng = random.Random(1234)
    for _ in range(5000):
        frames = [rng.randbytes(rng.randrange(0, 40)) for _ in range(rng.randrange(0, 4))]
        _decode_only_protocol_errors(frames)


def test_fuzz_truncated_and_mutated_frames_never_crash_the_decoder() -> None:
    rng = random.Random(99)
    good = p.encode(p.GENERATE, "id-1", {"prompt": "a cat", "n": 2, "seed": [1, 2]}, [b"blob"])
    header = good[0]
    for cut in range(len(header)):
        _decode_only_protocol_errors([header[:cut]])
    for _ in range(3000):
        mutated = bytearray(header)
        for _ in range(rng.randrange(1, 4)):
            mutated[rng.randrange(len(mutated))] = rng.randrange(256)
        _decode_only_protocol_errors([bytes(mutated), *good[1:]])
        try:
            body = msgspec.msgpack.decode(bytes(mutated))
        except (msgspec.DecodeError, ValueError, TypeError):
            continue
        if isinstance(body, dict):
            with contextlib.suppress(p.RequestError):
                pv.parse_generate(body.get("body"), LIMITS)


# ---------------------------------------------------------------- deadlines and cancel


def test_a_deadline_travels_in_the_header_and_is_absent_without_one() -> None:
    timed = p.decode(p.encode(p.GENERATE, "t", {"prompt": "x"}, timeout_ms=1500))
    assert (timed.id, timed.kind, timed.timeout_ms) == ("t", p.GENERATE, 1500)
    plain = p.encode(p.GENERATE, "u", {"prompt": "x"})
    assert p.decode(plain).timeout_ms is None
    # No deadline, no field: the header is byte for byte what version 1 always sent.
    v1 = {"v": 1, "id": "u", "kind": p.GENERATE, "body": {"prompt": "x"}}
    assert plain[0] == msgspec.msgpack.encode(v1)


def test_a_peer_that_predates_deadlines_reads_the_header_and_ignores_it() -> None:
    class OldHeader(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
        v: int
        id: str
        kind: str
        body: msgspec.Raw = msgspec.Raw(b"\x80")

    old = msgspec.msgpack.decode(
        p.encode(p.GENERATE, "t", {"a": 1}, timeout_ms=5)[0], type=OldHeader
    )
    assert (old.v, old.id, old.kind) == (p.PROTOCOL_VERSION, "t", p.GENERATE)
    assert msgspec.msgpack.decode(old.body) == {"a": 1}


@pytest.mark.parametrize("timeout_ms", [-1, "soon", 1.5, [3]])
def test_a_bad_deadline_is_refused_with_the_request_id(timeout_ms: object) -> None:
    header = msgspec.msgpack.encode(
        {"v": 1, "id": "late", "kind": p.GENERATE, "body": {}, "timeout_ms": timeout_ms}
    )
    with pytest.raises(p.ProtocolError) as err:
        p.decode([header])
    assert err.value.request_id == "late" and "timeout_ms" in str(err.value)


def test_cancel_names_a_request_and_a_bad_cancel_body_is_a_protocol_error() -> None:
    message = p.decode(p.encode(p.CANCEL, "c1", p.CancelRequest(request_id="r9")))
    assert message.kind == p.CANCEL and p.CANCEL in p.REQUEST_KINDS
    assert message.body_as(p.CancelRequest) == p.CancelRequest(request_id="r9")
    for body in ({}, {"request_id": 5}, [1, 2], "r9"):
        with pytest.raises(p.ProtocolError) as err:
            p.decode(p.encode(p.CANCEL, "c2", body)).body_as(p.CancelRequest)
        assert err.value.request_id == "c2"


def test_dropped_work_has_codes_a_front_end_maps() -> None:
    assert p.RequestError(p.CANCELLED, "gone").status == 499
    assert p.RequestError(p.DEADLINE_EXCEEDED, "late").status == 504
