"""Property-based fuzzing of every HTTP route the router's OpenAPI schema declares.

schemathesis reads ``/openapi.json`` from the app and generates requests for each
operation, bodies that fit the declared models and bodies that do not; each is
sent in-process (ASGI) with a valid admin key to the real router, whose lifespan
runs over an in-process replica speaking the real wire protocol on a real ZMQ
socket (tests/stub_replica.py). No answer may be a 5xx.

About 50 s of CPU; ``DPSERVE_FUZZ_EXAMPLES`` sets the examples per operation and
mode (default 60: 2,704 cases over 27 operations, no 5xx). The figures are printed
and recorded as ``fuzz_cases`` and ``fuzz_5xx`` (``pytest -s`` or ``--junitxml``
shows them).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import time
import warnings
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import hypothesis
import schemathesis
import zmq.asyncio
from fastapi import FastAPI
from hypothesis import HealthCheck, Phase
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.generation import GenerationMode
from schemathesis.python import asgi

from dpserve.router.app import RouterSettings, create_app
from dpserve.router.pool import PoolSettings
from tests.stub_replica import StubReplica

ADMIN_KEY = "sk-fuzz-admin"
EXAMPLES = int(os.environ.get("DPSERVE_FUZZ_EXAMPLES", "60"))
# Released weights make every other op a (correct) 503 "resume first": these run
# first, release then resume, so the state the others see is a serving one.
FIRST = ("POST /release_memory_occupation", "POST /resume_memory_occupation")
SHUTDOWN_S = 30


class StubbedRouter:
    """An ASGI app: its lifespan starts a stub replica, then the router over it."""

    def __init__(self, settings: RouterSettings) -> None:
        self.settings = settings
        self.app: FastAPI | None = None
        self.hung_shutdown: str | None = None  # the pending tasks, if shutdown hung

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        assert self.app is not None, "the lifespan has not started"
        await self.app(scope, receive, send)

    async def _lifespan(self, receive: Any, send: Any) -> None:
        assert (await receive())["type"] == "lifespan.startup"
        async with contextlib.AsyncExitStack() as running:
            await running.enter_async_context(self._running())
            await send({"type": "lifespan.startup.complete"})
            assert (await receive())["type"] == "lifespan.shutdown"
            # Bounded: once in a full suite run (never alone) this shutdown waited
            # forever on some task; the test then reports which instead of hanging.
            seen: list[str] = []  # where every task waits, taken just before giving up
            look = asyncio.get_running_loop().call_later(
                SHUTDOWN_S, lambda: seen.append(_pending_stacks())
            )
            try:
                async with asyncio.timeout(SHUTDOWN_S + 1):
                    await running.aclose()
            except TimeoutError:
                self.hung_shutdown = "\n".join(seen)
            finally:
                look.cancel()
        await send({"type": "lifespan.shutdown.complete"})

    @asynccontextmanager
    async def _running(self) -> AsyncIterator[None]:
        ctx = zmq.asyncio.Context()
        stub = StubReplica(ctx)
        settings = dataclasses.replace(self.settings, workers=(stub.endpoint,))
        self.app = create_app(settings)
        try:
            async with self.app.router.lifespan_context(self.app):
                transport = httpx.ASGITransport(app=self.app)
                async with httpx.AsyncClient(
                    transport=transport, base_url="http://localhost"
                ) as http:
                    deadline = time.monotonic() + 10
                    while (await http.get("/ready")).status_code != 200:
                        assert time.monotonic() < deadline, "the stub replica never served"
                        await asyncio.sleep(0.02)
                yield
        finally:
            await stub.close()
            ctx.term()


def _pending_stacks() -> str:
    """Every pending task of the running loop with where it waits (innermost last)."""
    lines = []
    for task in asyncio.all_tasks():
        where = " -> ".join(f"{f.f_code.co_filename}:{f.f_lineno}" for f in task.get_stack())
        lines.append(f"{task.get_name()}: {where or repr(task.get_coro())}")
    return "\n".join(lines)


def _operations(schema: Any) -> list[Any]:
    operations = [result.ok() for result in schema.get_all_operations()]
    return sorted(operations, key=lambda o: FIRST.index(o.label) if o.label in FIRST else 9)


@dataclasses.dataclass
class Tally:
    cases: int = 0
    unmade: int = 0  # cases schemathesis failed to make (its Binary bug, below)
    failures: list[str] = dataclasses.field(default_factory=list)


@st.composite
def _made(draw: st.DrawFn, cases: st.SearchStrategy[Any], tally: Tally) -> Any:
    """A case, or none where schemathesis cannot make one: its allOf strategy hands a
    multipart body holding a file (its ``Binary``) to jsonschema-rs, which raises
    "Unsupported type: 'Binary'" (seen with 4.32.5). Which draws hit it depends on every
    constant it collects from the app's code, so an unrelated change can make a run
    meet it. Such a draw is rejected and counted; the test bounds how many."""
    try:
        return draw(cases)
    except ValueError as exc:
        if "Unsupported type: 'Binary'" not in str(exc):
            raise
        tally.unmade += 1
        hypothesis.reject()


def _drive(operation: Any, mode: GenerationMode, headers: dict[str, str], tally: Tally) -> None:
    """``EXAMPLES`` generated requests to one operation; 5xx answers are collected."""

    @hypothesis.settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        derandomize=True,  # the same cases every run: a failure reproduces
        phases=[Phase.explicit, Phase.generate],  # no shrinking: every failure is kept
        suppress_health_check=list(HealthCheck),
    )
    @hypothesis.given(case=_made(operation.as_strategy(generation_mode=mode), tally))
    def run(case: Any) -> None:
        tally.cases += 1
        try:
            response = case.call(headers=headers)
        except Exception as exc:  # the app raised: a server answers that with a 500
            tally.failures.append(f"{case.operation.label} ({mode}): raised {exc!r}")
            return
        try:
            case.validate_response(response, checks=[not_a_server_error])
        except Exception:
            tally.failures.append(
                f"{case.operation.label} ({mode}): {response.status_code} "
                f"{response.text[:300]}\n  {case.as_curl_command()}"
            )

    with contextlib.suppress(hypothesis.errors.Unsatisfiable):
        run()  # Unsatisfiable: nothing invalid to generate (no parameters, no body)


def test_no_route_answers_a_server_error(
    tmp_path: Path, record_property: Callable[[str, object], None]
) -> None:
    settings = RouterSettings(
        pool=PoolSettings(ping_interval_s=0.2, request_timeout_s=10, control_timeout_s=10),
        api_keys=("sk-fuzz-inference",),
        admin_keys=(ADMIN_KEY,),
        output_dir=tmp_path / "images",  # response_format=url and /v1/images/files serve
        allowed_hosts=("testserver",),  # the Host schemathesis sends in-process
    )
    app = StubbedRouter(settings)
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    tally, started = Tally(), time.perf_counter()
    operations = _operations(schema)
    try:
        for operation in operations:
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                _drive(operation, mode, headers, tally)
    finally:
        asgi.shutdown_lifespans()  # the stub replica and the router's pool
    took = time.perf_counter() - started
    print(
        f"fuzz operations={len(operations)} cases={tally.cases} "
        f"server_errors={len(tally.failures)} unmade={tally.unmade} "
        f"seconds={took:.1f}"
    )
    record_property("fuzz_cases", tally.cases)
    record_property("fuzz_5xx", len(tally.failures))
    if app.hung_shutdown is not None:
        # Not what this test proves (no 5xx); shown in the summary with where it waited.
        record_property("fuzz_shutdown_hung", app.hung_shutdown)
        warnings.warn(f"the router's shutdown hung; pending:\n{app.hung_shutdown}", stacklevel=1)
    assert tally.cases >= len(operations) * EXAMPLES  # every operation was driven
    assert tally.unmade <= tally.cases // 20, f"schemathesis made too few: {tally.unmade} unmade"
    assert not tally.failures, "\n".join(tally.failures[:20])
