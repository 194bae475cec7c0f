"""A client that stops reading its stream slows nothing but its own stream.

Real TCP: the router under uvicorn, a stub replica sending previews of 2 MB each,
and a client that sends a streamed request and reads nothing, so the kernel's
buffers fill and the router's sends to it wait. Meanwhile another client's request
is answered at once, and the stalled stream, read at last, has lost nothing.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import zmq.asyncio

from dpserve.router.app import RouterSettings
from dpserve.router.pool import PoolSettings
from tests.stub_replica import StubReplica
from tests.unit.test_router_edges import _serving

PREVIEW = b"\x89PNG" + bytes(2 << 20)  # 2 MB: 12 of them (2.7 MB each as base64) fill buffers
STREAMED = {"prompt": "x", "size": "64x64", "n": 4, "stream": True, "partial_images": 3}


def test_a_stalled_stream_delays_only_itself() -> None:
    async def scenario() -> None:
        ctx = zmq.asyncio.Context()
        stub = StubReplica(ctx, preview=PREVIEW)
        pool = PoolSettings(ping_interval_s=0.05, ping_timeout_s=0.5)
        try:
            async with _serving(RouterSettings(workers=(stub.endpoint,), pool=pool)) as address:
                host, port = address.split(":")
                url = f"http://{address}"
                async with httpx.AsyncClient(base_url=url, timeout=30) as http:
                    while (await http.get("/ready")).status_code != 200:
                        await asyncio.sleep(0.02)
                    reader, writer = await asyncio.open_connection(host, int(port))
                    body = json.dumps(STREAMED).encode()
                    writer.write(
                        b"POST /v1/images/generations HTTP/1.1\r\nHost: localhost\r\n"
                        b"Content-Type: application/json\r\n"
                        + f"Content-Length: {len(body)}\r\n\r\n".encode()
                        + body
                    )
                    await writer.drain()
                    # The stub has sent every preview and its result by now; the
                    # stalled client has read none of the ~40 MB of events.
                    while stub.generated < 1:
                        await asyncio.sleep(0.02)
                    start = time.perf_counter()
                    other = await http.post(
                        "/v1/images/generations", json={"prompt": "y", "size": "64x64"}
                    )
                    took = time.perf_counter() - start
                    assert other.status_code == 200, other.text
                    assert took < 2.0, f"another client waited {took:.2f}s behind a stalled one"
                    raw = await asyncio.wait_for(_read_chunked_events(reader), 30)
                    writer.close()
            kinds = [event["type"] for event in raw]
            assert kinds.count("image_generation.partial_image") == 12
            assert kinds.count("image_generation.completed") == 4
        finally:
            await stub.close()
            ctx.term()

    asyncio.run(scenario())


async def _read_chunked_events(reader: asyncio.StreamReader) -> list[dict[str, object]]:
    """Every event of the response, read until the stream's last chunk."""
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head[:200]
    body = bytearray()
    while True:
        size = int((await reader.readuntil(b"\r\n")).strip(), 16)
        chunk = await reader.readexactly(size + 2)
        if size == 0:
            break
        body += chunk[:-2]
    return [json.loads(line[5:]) for line in body.decode().splitlines() if line.startswith("data:")]
