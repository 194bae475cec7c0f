"""Realtime sessions, the pure parts: client messages, session ids, placement."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from dpserve.contract import protocol as p
from dpserve.contract import realtime as rt
from dpserve.contract import validation as pv
from dpserve.router.policies import hrw_order, hrw_owner
from dpserve.router.realtime_ws import frame_message
from dpserve.router.sessions import Frame, make_session_id, session_owner

LIMITS = pv.Limits(size_factor=16, min_side=16, max_side=512, max_steps=50)
PNG = b"\x89PNG\r\n\x1a\n" + bytes(20)  # a PNG's signature: the router reads no further


def _fields(exc: pytest.ExceptionInfo[p.RequestError]) -> set[str]:
    return {f.field for f in exc.value.fields}


def _decoded(**fields: object) -> Any:
    """A client message as the router gets it: msgpack bytes, decoded to its type."""
    return rt.decode_client(msgspec.msgpack.encode(fields))


def _init(**fields: object) -> rt.ClientInit:
    message = _decoded(type="init", **fields)
    assert isinstance(message, rt.InitMessage)
    return rt.parse_init(message, LIMITS)


def test_init_defaults_follow_sglang() -> None:
    init = _init(prompt="a fox")
    assert init.params.seed == 42
    assert init.params.output_format == "png"
    assert init.params.frame_steps == 2 and init.params.strength == 0.5
    assert init.options == rt.StreamOptions(mode="stream", fps=None, max_frames=None)
    assert init.first_frame is None


def test_init_takes_sglang_aliases_and_size() -> None:
    init = _init(
        prompt="a fox",
        size="128x64",
        seed=7,
        realtime_output_format="jpeg",
        max_chunks=5,
        mode="step",
        first_frame=PNG,
    )
    assert (init.params.width, init.params.height, init.params.seed) == (128, 64, 7)
    assert init.params.output_format == "jpeg"
    assert init.options.max_frames == 5 and init.options.mode == "step"
    assert init.first_frame == PNG


def test_init_names_every_bad_value() -> None:
    with pytest.raises(p.RequestError) as exc:
        _init(
            size="100x64",
            seed=-1,
            mode="burst",
            strength=2.0,
            frame_steps=0,
            fps=0.0,
            first_frame=b"GIF89a" + bytes(20),  # PNG, JPEG and WebP only
            output_format="gif",
        )
    assert exc.value.code == p.INVALID_REQUEST
    assert not isinstance(exc.value, rt.Malformed)  # well-formed: the socket stays open
    assert _fields(exc) == {
        "prompt",
        "size",
        "seed",
        "mode",
        "strength",
        "frame_steps",
        "fps",
        "first_frame",
        "output_format",
    }
    assert "multiple of 16" in str(exc.value)


def test_max_frames_and_its_alias_are_exclusive() -> None:
    with pytest.raises(p.RequestError) as exc:
        _init(prompt="x", max_frames=2, max_chunks=3)
    assert _fields(exc) == {"max_frames"}


@pytest.mark.parametrize(
    ("raw", "needle", "close_code"),
    [
        (b"\xc1", "not valid msgpack", rt.UNREADABLE),
        (msgspec.msgpack.encode([1, 2]), "msgpack map", rt.UNREADABLE),
        (msgspec.msgpack.encode({"prompt": "x"}), '"type"', rt.UNREADABLE),
        (msgspec.msgpack.encode({"type": 3}), '"type"', rt.UNREADABLE),
        ('{"type": "init"}', "binary msgpack", rt.UNREADABLE),
        # A field of the wrong type, or one its type lacks: not a client message.
        (msgspec.msgpack.encode({"type": "init", "seed": "7"}), "$.seed", rt.UNREADABLE),
        (msgspec.msgpack.encode({"type": "init", "prompt": [[]]}), "$.prompt", rt.UNREADABLE),
        (msgspec.msgpack.encode({"type": "init", "colour": "red"}), "colour", rt.UNREADABLE),
        (msgspec.msgpack.encode({"type": "resume", "prompt": "x"}), "prompt", rt.UNREADABLE),
        (msgspec.msgpack.encode({"type": "prompt", "prompt": 5}), "$.prompt", rt.UNREADABLE),
        (b"\x82\xa4type\xa4step\xa1x" + b"\x91" * 100_000 + b"\x01", "nest", rt.UNREADABLE),
        (
            msgspec.msgpack.encode({"type": "init", "prompt": "x" * (9 << 20)}),
            "at most",
            rt.TOO_BIG,
        ),
        (msgspec.msgpack.encode({"type": "step", "x": bytes(300_000)}), "at most", rt.TOO_BIG),
    ],
)
def test_malformed_client_messages_are_refused_clearly(
    raw: bytes | str, needle: str, close_code: int
) -> None:
    with pytest.raises(rt.Malformed) as exc:
        rt.decode_client(raw)
    assert needle in str(exc.value)
    assert exc.value.close_code == close_code


def test_fields_a_message_does_not_read_are_skipped_unbuilt() -> None:
    """A step (or prompt) may carry fields SGLang's clients add; the router builds none of
    them, so 200 KB of empty arrays costs what reading them does."""
    junk = b"\xa4junk\xdd" + (200_000).to_bytes(4, "big") + b"\x90" * 200_000
    assert rt.decode_client(b"\x82\xa4type\xa4step" + junk) == rt.PlainMessage(type="step")
    prompt = b"\x83\xa4type\xa6prompt\xa6prompt\xa3cat" + junk
    assert rt.parse_prompt(rt.decode_client(prompt)) == "cat"
    assert rt.decode_client(msgspec.msgpack.encode({"type": "dance"})) == rt.PlainMessage(
        type="dance"
    )  # an unknown type is the connection's to answer (an error; the socket stays)


def test_prompt_messages_take_action_content_or_prompt() -> None:
    assert rt.parse_prompt(_decoded(type="prompt", action_content="a cat")) == "a cat"
    assert rt.parse_prompt(_decoded(type="prompt", prompt="a dog")) == "a dog"
    with pytest.raises(p.RequestError) as exc:
        rt.parse_prompt(_decoded(type="prompt", action_content="x" * 20_000))
    assert _fields(exc) == {"action_content"}


def test_resume_needs_a_session_id() -> None:
    session_id, options = rt.parse_resume(
        _decoded(type="resume", session_id="abc.def", mode="step")
    )
    assert session_id == "abc.def" and options.mode == "step"
    with pytest.raises(p.RequestError) as exc:
        rt.parse_resume(_decoded(type="resume", fps=5000))
    assert _fields(exc) == {"session_id", "fps"}


def test_session_request_checks_what_each_action_needs() -> None:
    ok = rt.session_request(rt.SessionRequest(action="step", session_id="s"))
    assert ok.action == "step"
    for bad, needle in (
        (rt.SessionRequest(action="jump", session_id="s"), "unknown session action"),
        (rt.SessionRequest(action="step", session_id=""), "session_id"),
        (rt.SessionRequest(action="open", session_id="s"), "params"),
        (rt.SessionRequest(action="step", session_id="s", prompt="x" * 20_000), "prompt"),
    ):
        with pytest.raises(p.RequestError, match=needle):
            rt.session_request(bad)


def test_session_id_carries_its_owner() -> None:
    owner = "tcp://10.244.0.17:5555"
    session_id = make_session_id("a" * 32, owner)
    assert session_id.startswith("a" * 32 + ".")
    assert session_owner(session_id) == owner
    assert "=" not in session_id  # safe in URLs and logs


@pytest.mark.parametrize("bad", ["", "nodot", ".dGNw", "abc.!!!", "abc.aGVsbG8"])
def test_foreign_session_ids_are_refused(bad: str) -> None:
    with pytest.raises(p.RequestError, match="not a session id"):
        session_owner(bad)


def test_hrw_order_is_stable_when_replicas_join() -> None:
    keys = [f"tcp://10.0.0.{i}:5555" for i in range(4)]
    moved = 0
    for n in range(200):
        session = f"session-{n}"
        before = hrw_order(session, keys)
        after = hrw_order(session, [*keys, "tcp://10.0.0.9:5555"])
        # The old keys keep their relative order; only the newcomer is slotted in.
        assert [k for k in after if k in keys] == before
        assert hrw_owner(session, keys) == before[0]
        moved += after[0] != before[0]
    assert 10 < moved < 90  # about 1/5 of new placements would go to the newcomer


def test_hrw_spreads_sessions() -> None:
    keys = ["tcp://a:1", "tcp://b:1", "tcp://c:1"]
    owners = [hrw_owner(f"s{n}", keys) for n in range(600)]
    assert all(150 < owners.count(k) < 250 for k in keys)


def test_frames_travel_as_binary_msgpack() -> None:
    meta = rt.FrameResult(
        session_id="s",
        replica=1,
        index=3,
        epoch=0,
        blob=0,
        format="png",
        width=64,
        height=64,
        inference_time_s=0.01,
        state_bytes=1024,
    )
    raw = frame_message(Frame(meta, b"\x89PNG\r\n\x1a\nrest"))
    assert b"\x89PNG\r\n\x1a\nrest" in raw  # the bytes themselves, not base64
    decoded = msgspec.msgpack.decode(raw)
    assert decoded["type"] == "frame" and decoded["content"].startswith(b"\x89PNG")
    assert (decoded["index"], decoded["replica"]) == (3, 1)
