"""A router app run in this process: its lifespan, and an httpx client over ASGI."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI


@asynccontextmanager
async def serving_client(
    app: FastAPI, timeout_s: float = 30, ready_within_s: float = 10
) -> AsyncIterator[httpx.AsyncClient]:
    """A client of ``app`` (lifespan running) once ``/ready`` says a replica serves.

    ``localhost``: a Host the router answers to without ``--allowed-host``."""
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(
            transport=transport, base_url="http://localhost", timeout=timeout_s
        ) as http:
            deadline = time.monotonic() + ready_within_s
            while (await http.get("/ready")).status_code != 200:
                assert time.monotonic() < deadline, "no replica served"
                await asyncio.sleep(0.02)
            yield http
