"""The ports a command claims before its slow start (dpserve/plumbing/bind.py)."""

from __future__ import annotations

import socket

import pytest

from dpserve.plumbing.bind import PortUnavailable, check_tcp, hold_tcp
from dpserve.plumbing.ports import free_port


def test_a_free_port_is_held_bound_until_handed_on() -> None:
    port = free_port()
    held = hold_tcp("127.0.0.1", port)
    try:
        assert [s.getsockname() for s in held] == [("127.0.0.1", port)]
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("127.0.0.1", port))  # held: nobody takes it in between
        held[0].listen()  # what the server does with it
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
    finally:
        for s in held:
            s.close()


def test_a_listening_port_is_refused_by_number_and_flag() -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", free_port()))
        squatter.listen()
        port = squatter.getsockname()[1]
        for claim in (hold_tcp, check_tcp):
            with pytest.raises(PortUnavailable) as caught:
                claim("127.0.0.1", port, "--port")
            assert str(caught.value) == (
                f"port {port} is taken (127.0.0.1:{port}): stop what holds it, "
                "or pick another --port"
            )
        # 0.0.0.0 covers 127.0.0.1: taken there as well.
        with pytest.raises(PortUnavailable, match=f"port {port} is taken"):
            check_tcp("0.0.0.0", port)


def test_check_releases_what_it_bound() -> None:
    port = free_port()
    check_tcp("127.0.0.1", port)
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_an_address_not_of_this_machine_and_an_unresolvable_one() -> None:
    with pytest.raises(PortUnavailable) as caught:
        check_tcp("192.0.2.1", free_port())  # TEST-NET-1: only bound, never sent to
    assert "192.0.2.1 is not an address of this machine" in str(caught.value)
    with pytest.raises(PortUnavailable) as caught:
        check_tcp("no-such-host.invalid", free_port())
    assert "cannot resolve the address 'no-such-host.invalid'" in str(caught.value)
