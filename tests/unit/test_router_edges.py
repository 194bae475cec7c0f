"""The HTTP server's edges on a real uvicorn server: the limits are flags, and a
WebSocket that never sends its init is closed with a clear reason (connection slots:
tests/unit/test_router_slots.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import msgspec
import pytest
import uvicorn
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from dpserve.cli import _router_settings, build_parser
from dpserve.router.app import RouterSettings, create_app, server_config
from dpserve.router.http_server import GuardedConfig
from dpserve.router.realtime_ws import INIT_TIMEOUT, RealtimeSettings
from tests.workers import free_port


@asynccontextmanager
async def _serving(settings: RouterSettings) -> AsyncIterator[str]:
    """The router app under uvicorn on a free port (no replicas: /livez still answers)."""
    port = free_port()
    config = server_config(create_app(settings), "127.0.0.1", port, settings)
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        assert not task.done(), "uvicorn did not start"
        await asyncio.sleep(0.02)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


def test_the_limits_are_flags_and_reach_uvicorn() -> None:
    args = build_parser().parse_args(
        [
            *("router", "--worker", "tcp://x:1", "--max-connections", "7", "--backlog", "64"),
            *("--output-max-files", "5", "--output-max-age", "60"),
        ]
    )
    settings = _router_settings(args, args.worker)
    assert (settings.max_connections, settings.backlog) == (7, 64)
    assert (settings.output_max_files, settings.output_max_age_s) == (5, 60.0)
    config = server_config(create_app(settings), "127.0.0.1", 1, settings)
    assert isinstance(config, GuardedConfig)  # the cap: tests/unit/test_router_slots.py
    assert (config.book.limits.max_connections, config.backlog) == (7, 64)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["router", "--max-connections", "0"])


def test_the_video_job_bound_is_a_router_and_serve_flag() -> None:
    for command in (["router", "--worker", "tcp://x:1"], ["serve"]):
        args = build_parser().parse_args([*command, "--video-max-estimate", "90"])
        assert _router_settings(args, ()).video_max_estimate_s == 90.0
        default = build_parser().parse_args(command)
        assert _router_settings(default, ()).video_max_estimate_s == 1800.0  # docs/video.md
        with pytest.raises(SystemExit):
            build_parser().parse_args([*command, "--video-max-estimate", "0"])


def test_a_websocket_that_sends_no_init_is_closed_with_a_reason() -> None:
    async def scenario() -> None:
        settings = RouterSettings(realtime=RealtimeSettings(init_timeout_s=0.5))
        async with _serving(settings) as address:
            url = f"ws://{address}/v1/realtime_video/generate"
            async with connect(url) as ws:
                started = time.monotonic()
                await ws.send(msgspec.msgpack.encode({"type": "init"}))  # an error, no more time
                assert msgspec.msgpack.decode(await ws.recv())["type"] == "error"
                message = msgspec.msgpack.decode(await asyncio.wait_for(ws.recv(), 5))
                waited = time.monotonic() - started
                assert message["type"] == "error" and message["code"] == "init_timeout"
                assert "send init first" in message["content"]
                with pytest.raises(ConnectionClosed) as closed:
                    await ws.recv()
                assert closed.value.rcvd is not None and closed.value.rcvd.code == INIT_TIMEOUT
                assert 0.4 < waited < 3

    asyncio.run(scenario())
