"""The wire contract: round trips, field validation, and a decoder no input can crash."""

from __future__ import annotations

import contextlib
import random

import msgspec
import pytest

from dpserve import protocol as p

LIMITS = p.Limits(size_factor=16, min_side=16, max_side=1024, max_steps=50)


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
    params = p.parse_generate({"prompt": "a cat", "n": 3, "seed": 10, "size": "64x32"}, LIMITS)
    assert params.seed == [10, 11, 12]
    assert (params.width, params.height) == (64, 32)
    assert params.num_inference_steps is None and params.output_format == "png"
    listed = p.parse_generate({"prompt": "a", "n": 2, "seed": [4, 4]}, LIMITS)
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
        p.parse_generate(body, LIMITS)
    assert err.value.code == p.INVALID_REQUEST
    assert {f.field for f in err.value.fields} == fields
    for name in fields:
        assert name in str(err.value)


def test_non_object_body_is_refused() -> None:
    with pytest.raises(p.RequestError):
        p.parse_generate([1, 2], LIMITS)


def test_unknown_control_op_is_refused() -> None:
    with pytest.raises(p.RequestError) as err:
        p.parse_control(p.ControlRequest(op="format_disk"))
    assert err.value.code == p.UNSUPPORTED
    assert p.parse_control(p.ControlRequest(op="set_lora")).op == "set_lora"
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
                p.parse_generate(body.get("body"), LIMITS)
