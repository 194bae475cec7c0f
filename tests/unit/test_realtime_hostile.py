"""A hostile realtime message, over a real socket: the router closes that socket and
goes on answering everyone else.

Real TCP: the router under uvicorn (no replicas: a message sent before ``init`` is
read the same), a WebSocket client sending one hostile message, ``/livez`` polled
meanwhile, and the process's RSS sampled from a thread (the router runs in this
process, so its memory is the test's). Before client messages were typed, the first
case held the event loop for 20 s or more and grew the process by 2.3 GB, and the
socket stayed open.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import Iterator

import httpx
import msgspec
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from dpserve.contract import realtime as rt
from dpserve.router.app import RouterSettings
from tests.unit.test_router_edges import _serving

PATH = "/v1/realtime_video/generate"
LIVEZ_BOUND_S = 1.0  # the slowest /livez while the message is read (it was 21.9 s)
RSS_BOUND = 256 << 20  # growth of this process, the client's copies included (was 2.3 GB)


def _empty_arrays(count: int) -> bytes:
    return b"\xdd" + count.to_bytes(4, "big") + b"\x90" * count


HOSTILE = {
    # The probe of issue 28: within the old 16 MiB cap, refused now by its size alone.
    "16 MiB of empty arrays": (_empty_arrays((16 << 20) - 5), rt.TOO_BIG),
    # Within the new cap: an init whose prompt is 8 MiB of empty arrays.
    "an init's prompt of empty arrays": (
        b"\x82\xa4type\xa4init\xa6prompt" + _empty_arrays(8 << 20),
        rt.UNREADABLE,
    ),
}


def _rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@contextlib.contextmanager
def _peak_rss() -> Iterator[list[int]]:
    """The highest RSS seen while the block runs, sampled every 5 ms: ``[base, peak]``."""
    seen = [_rss(), _rss()]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.005):
            seen[1] = max(seen[1], _rss())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield seen
    finally:
        done.set()
        sampler.join()


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_hostile_message_closes_its_socket_and_stalls_nobody(case: str) -> None:
    raw, close_code = HOSTILE[case]

    async def scenario() -> tuple[float, int | None]:
        async with (
            _serving(RouterSettings()) as address,
            httpx.AsyncClient(base_url=f"http://{address}", timeout=60) as http,
        ):
            assert (await http.get("/livez")).status_code == 200
            slowest = 0.0
            reading = True

            async def poll() -> None:
                nonlocal slowest
                while reading:
                    started = time.perf_counter()
                    assert (await http.get("/livez")).status_code == 200
                    slowest = max(slowest, time.perf_counter() - started)
                    await asyncio.sleep(0.01)

            poller = asyncio.create_task(poll())
            async with connect(f"ws://{address}{PATH}") as ws:
                with contextlib.suppress(ConnectionClosed):
                    await ws.send(raw)
                code = None
                with pytest.raises(ConnectionClosed) as closed:
                    while True:  # an error first where the message was read
                        reply = msgspec.msgpack.decode(await asyncio.wait_for(ws.recv(), 30))
                        assert reply["type"] == "error", reply
                        assert reply["code"] == "invalid_request"
                if closed.value.rcvd is not None:
                    code = closed.value.rcvd.code
            reading = False
            await poller
            return slowest, code

    with _peak_rss() as rss:
        slowest, code = asyncio.run(scenario())
    assert code == close_code
    assert slowest < LIVEZ_BOUND_S, f"/livez took {slowest:.2f}s while the message was read"
    grown = rss[1] - rss[0]
    assert grown < RSS_BOUND, f"the process grew by {grown >> 20} MiB"
