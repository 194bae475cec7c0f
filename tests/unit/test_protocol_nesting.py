"""Msgpack nested past the decoder's depth is a ProtocolError like any other defect
(found by tests/e2e/test_zmq_fuzz.py: it used to escape as a RecursionError)."""

from __future__ import annotations

import msgspec
import pytest

from dpserve.contract import protocol as p

DEEP = b"\x91" * 100_000 + b"\xc0"


def test_a_deep_header_is_a_protocol_error() -> None:
    with pytest.raises(p.ProtocolError) as caught:
        p.decode([DEEP])
    assert caught.value.request_id is None


def test_a_deep_body_is_a_protocol_error() -> None:
    """Refused while the header is read (the decoder walks the body to find its end),
    so the id is lost too: the ingress drops it and logs it, unanswered."""
    enc = msgspec.msgpack.encode
    fields = {"v": p.PROTOCOL_VERSION, "id": "deep", "kind": p.GENERATE}
    header = b"\x84" + b"".join(enc(k) + enc(v) for k, v in fields.items()) + enc("body") + DEEP
    with pytest.raises(p.ProtocolError):
        p.decode([header]).body_as(dict)
