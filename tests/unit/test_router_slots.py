"""Connection slots (dpserve/router/slots.py) and the guarded uvicorn protocol
(dpserve/router/http_server.py): silent sockets neither hold a slot for long nor lock
out the probes, one address cannot hold every slot, and refusals are JSON."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx
import pytest
import uvicorn
from websockets.asyncio.client import connect

from dpserve.cli import _router_settings, build_parser
from dpserve.router.app import RouterSettings, create_app, server_config
from dpserve.router.http_server import GuardedConfig
from dpserve.router.slots import SlotBook, SlotLimits, peer_of
from tests.workers import free_port

# ---------------------------------------------------------------- the book


def test_a_newcomer_past_the_total_displaces_the_oldest_idle() -> None:
    book: SlotBook[str] = SlotBook(SlotLimits(max_connections=2))
    assert book.opened("a", "p") == [] and book.opened("b", "q") == []
    assert book.opened("c", "r") == ["a"]  # the oldest idle gives way
    assert book.busy("b", "/v1/models") == ([], None)
    assert book.opened("d", "s") == ["c"]  # b is busy: c is the oldest idle
    assert book.busy("d", "/x") == ([], None) and book.open == 2
    # Both busy, nothing to displace: a third is refused, but a probe is served.
    assert book.opened("e", "t") == []
    shed, over = book.busy("e", "/v1/models")
    assert shed == [] and over is not None and over.status == 503
    assert "--max-connections 2" in over.message
    assert book.opened("f", "u") == []  # nothing idle: all are busy
    assert book.busy("f", "/livez") == ([], None)


def test_one_peer_displaces_its_own_idle_and_is_refused_past_its_cap() -> None:
    book: SlotBook[str] = SlotBook(SlotLimits(max_connections=100, max_per_peer=2))
    book.opened("other", "q")
    book.opened("a", "p")
    book.opened("b", "p")
    assert book.opened("c", "p") == ["a"]  # its own oldest, not another peer's
    book.busy("b", "/x")
    book.busy("c", "/x")
    book.opened("d", "p")
    shed, over = book.busy("d", "/v1/images/generations")
    assert shed == [] and over is not None and over.status == 429
    assert "--max-connections-per-peer 2" in over.message and "p has 3" in over.message
    assert book.busy("d", "/ready")[1] is None  # the probes pass any cap
    # One that went idle since a newcomer opened is displaced when its head arrives.
    book.closed("d")  # refused: uvicorn closes it after the answer
    assert book.opened("e", "p") == []
    book.idle("b")
    assert book.busy("e", "/x") == (["b"], None)
    for key in ("other", "c", "e"):
        book.closed(key)
    assert book.open == 0 and book.count("p") == 0


def test_a_peer_is_an_ipv4_address_or_an_ipv6_64() -> None:
    assert peer_of("10.1.2.3") == "10.1.2.3"
    assert peer_of("::ffff:10.1.2.3") == "10.1.2.3"
    assert peer_of("2001:db8:1:2:aaaa::1") == peer_of("2001:db8:1:2:bbbb::9") == "2001:db8:1:2::/64"
    assert peer_of("2001:db8:1:3::1") != peer_of("2001:db8:1:2::1")
    assert peer_of(None) == "local"


# ---------------------------------------------------------------- over real sockets


@dataclass
class Served:
    host: str
    port: int
    config: GuardedConfig

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


@asynccontextmanager
async def _serving(settings: RouterSettings) -> AsyncIterator[Served]:
    """The router app under uvicorn on a free port (no replicas: the probes answer)."""
    port = free_port()
    config = server_config(create_app(settings), "127.0.0.1", port, settings)
    assert isinstance(config, GuardedConfig)
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        assert not task.done(), "uvicorn did not start"
        await asyncio.sleep(0.02)
    try:
        yield Served("127.0.0.1", port, config)
    finally:
        server.should_exit = True
        await task


async def _silent(served: Served, count: int, sources: int = 1) -> list[socket.socket]:
    """``count`` connections that never send a byte (the router accepted each), from
    ``sources`` addresses (127.0.0.1, then 127.0.1.1, 127.0.1.2, …: all loopback)."""
    socks, per_source = [], Counter[str]()
    for i in range(count):
        source = "127.0.0.1" if i % sources == 0 else f"127.0.1.{i % sources}"
        sock = socket.create_connection((served.host, served.port), source_address=(source, 0))
        sock.setblocking(False)
        socks.append(sock)
        per_source[source] += 1
    book = served.config.book
    cap = book.limits.max_per_peer or count
    kept = min(book.limits.max_connections, sum(min(n, cap) for n in per_source.values()))
    deadline = time.monotonic() + 5
    while book.open < kept:
        assert time.monotonic() < deadline, "the router never accepted the flood"
        await asyncio.sleep(0.01)
    return socks


async def _recv_all(sock: socket.socket, within: float) -> bytes:
    """What the router sends until it closes the socket, within ``within`` seconds."""
    loop = asyncio.get_running_loop()
    data = b""
    while True:
        chunk = await asyncio.wait_for(loop.sock_recv(sock, 65536), within)
        if not chunk:
            return data
        data += chunk


def _timed_get(url: str, path: str) -> tuple[int, float]:
    """A fresh connection (not the pool's), as a kubelet probe makes."""
    started = time.monotonic()
    status = httpx.get(url + path, timeout=10).status_code
    return status, time.monotonic() - started


def test_a_flood_of_silent_sockets_locks_out_neither_probes_nor_requests() -> None:
    """Before: 21 silent sockets with --max-connections 20 made every call 503 for
    as long as they stayed open."""

    async def scenario(sources: int) -> None:
        settings = RouterSettings(
            max_connections=20, max_connections_per_peer=8, header_timeout_s=60
        )
        async with _serving(settings) as served:
            flood = await _silent(served, 60, sources)  # three times the cap
            try:
                for path, answer in (("/livez", 200), ("/ready", 503), ("/v1/models", 200)):
                    status, took = await asyncio.to_thread(_timed_get, served.url, path)
                    assert (status, path) == (answer, path)  # /ready: no replica here
                    assert took < 2, (path, took)
                assert served.config.book.open <= 20
                assert served.config.book.count("127.0.0.1") <= 8
            finally:
                for sock in flood:
                    sock.close()

    asyncio.run(scenario(sources=1))  # one address (the probe's own)
    asyncio.run(scenario(sources=30))  # many


def test_a_silent_socket_is_closed_and_a_slow_head_gets_408() -> None:
    async def scenario() -> None:
        async with _serving(RouterSettings(header_timeout_s=0.5)) as served:
            silent, slow = await _silent(served, 2)
            loop = asyncio.get_running_loop()
            await loop.sock_sendall(slow, b"GET /livez HTTP/1.1\r\nHost: localhost")
            started = time.monotonic()
            assert await _recv_all(silent, 5) == b""  # closed, nothing said
            answer = await _recv_all(slow, 5)
            assert time.monotonic() - started < 3
            head, _, body = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 408 ")
            error = json.loads(body)["error"]
            assert "--header-timeout 0.5" in error["message"]
            assert error["code"] == "request_timeout"
            # A kept-alive connection gets the same time for its next head.
            async with httpx.AsyncClient(base_url=served.url) as http:
                assert (await http.get("/livez")).status_code == 200
                deadline = time.monotonic() + 5
                while served.config.book.open:
                    assert time.monotonic() < deadline, "the idle keep-alive was kept"
                    await asyncio.sleep(0.05)
            for sock in (silent, slow):
                sock.close()

    asyncio.run(scenario())


async def _busy(served: Served, count: int) -> list[socket.socket]:
    """``count`` connections each in a request the router waits on (a body that does
    not come), from this address."""
    socks = await _silent(served, count)
    loop = asyncio.get_running_loop()
    head = (
        b"POST /v1/images/generations HTTP/1.1\r\nHost: localhost\r\n"
        b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"
    )
    for sock in socks:
        await loop.sock_sendall(sock, head)
    deadline = time.monotonic() + 5
    while served.config.book.waiting > served.config.book.open - count:
        assert time.monotonic() < deadline, "the requests never started"
        await asyncio.sleep(0.01)
    return socks


def test_busy_connections_past_a_cap_are_refused_in_json_but_probes_pass() -> None:
    async def scenario() -> None:
        for settings, status, flag in (
            (RouterSettings(max_connections_per_peer=2), 429, "--max-connections-per-peer 2"),
            (
                RouterSettings(max_connections=2, max_connections_per_peer=0),
                503,
                "--max-connections 2",
            ),
        ):
            async with _serving(settings) as served:
                held = await _busy(served, 2)
                try:
                    over = await asyncio.to_thread(httpx.get, served.url + "/v1/models")
                    assert over.status_code == status
                    assert flag in over.json()["error"]["message"]
                    assert over.headers["connection"] == "close" and over.headers["x-request-id"]
                    if status == 429:  # another address is not held to this one's cap
                        other = httpx.AsyncHTTPTransport(local_address="127.0.1.1")
                        async with httpx.AsyncClient(transport=other) as http:
                            assert (await http.get(served.url + "/v1/models")).status_code == 200
                    livez = await asyncio.to_thread(httpx.get, served.url + "/livez")
                    assert livez.status_code == 200
                    ready = await asyncio.to_thread(httpx.get, served.url + "/ready")
                    assert ready.status_code == 503 and ready.json()["ready"] is False  # no replica
                    ws_url = f"ws://{served.host}:{served.port}/v1/realtime_video/generate"
                    with pytest.raises(Exception) as refused:
                        async with connect(ws_url):
                            pass
                    assert str(status) in str(refused.value)
                finally:
                    for sock in held:
                        sock.close()

    asyncio.run(scenario())


def test_a_websocket_gives_its_slot_back_when_it_closes() -> None:
    async def scenario() -> None:
        async with _serving(RouterSettings()) as served:
            async with connect(f"ws://{served.host}:{served.port}/v1/realtime_video/generate"):
                assert served.config.book.open == 1
                assert not served.config.book.waiting  # busy: never displaced
            deadline = time.monotonic() + 5
            while served.config.book.open:
                assert time.monotonic() < deadline, "the WebSocket's slot was never freed"
                await asyncio.sleep(0.02)

    asyncio.run(scenario())


def test_the_connection_bounds_are_flags_of_router_and_serve() -> None:
    for command in (["router", "--worker", "tcp://x:1"], ["serve"]):
        args = build_parser().parse_args(
            [*command, "--max-connections-per-peer", "0", "--header-timeout", "2.5"]
        )
        settings = _router_settings(args, ())
        assert (settings.max_connections_per_peer, settings.header_timeout_s) == (0, 2.5)
        config = server_config(create_app(settings), "127.0.0.1", 1, settings)
        assert isinstance(config, GuardedConfig)
        assert config.book.limits == SlotLimits(1000, 0) and config.header_timeout_s == 2.5
        default = _router_settings(build_parser().parse_args(command), ())
        assert (default.max_connections_per_peer, default.header_timeout_s) == (256, 10.0)
        for bad in (["--max-connections-per-peer", "-1"], ["--header-timeout", "0"]):
            with pytest.raises(SystemExit):
                build_parser().parse_args([*command, *bad])
