"""Msgpack nested past the decoder's depth is a ProtocolError like any other defect
(found by tests/e2e/test_zmq_fuzz.py: it used to escape as a RecursionError)."""

from __future__ import annotations

import time
import tracemalloc

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


def _empty_arrays(count: int) -> bytes:
    """A msgpack array of ``count`` empty arrays: one byte each on the wire, a list each
    once built (about 75 bytes of Python objects per byte)."""
    return b"\xdd" + count.to_bytes(4, "big") + b"\x90" * count


@pytest.mark.parametrize("shape", ["id kept", "not a map"])
def test_a_hostile_header_costs_what_its_bytes_do(shape: str) -> None:
    """A broken header's id is salvaged for the error reply: by reading the id alone.
    Untyped, 16 MiB of empty arrays took seconds and more than 1 GB to look for it."""
    enc = msgspec.msgpack.encode
    junk = _empty_arrays(16 << 20)
    if shape == "id kept":  # the junk first, then an id, then a version of the wrong type
        header = b"\x83" + enc("junk") + junk + enc("id") + enc("h1") + enc("v") + enc("one")
    else:
        header = junk
    tracemalloc.start()
    started = time.perf_counter()
    try:
        with pytest.raises(p.ProtocolError) as caught:
            p.decode([header])
        took = time.perf_counter() - started
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert caught.value.request_id == ("h1" if shape == "id kept" else None)
    assert took < 2.0, f"{took:.2f}s for a {len(header)}-byte header"
    assert peak < len(header) // 4, f"{peak} bytes held for a {len(header)}-byte header"
