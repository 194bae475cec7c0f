"""Everything a request leaves behind is its tenant's (issue 28, hole 3; docs/tenants.md).

Two tenants (team-a with two keys, team-b with one) and an admin, on routers over
stub replicas speaking the real wire on real ZMQ sockets (tests/stub_replica.py,
which keeps ownership as a driver does: recorded with the work, checked on each
ask). Another tenant's video job, request, session or stored image is answered as
one that never existed; a second router (no state shared with the first) answers
the same, since the owner is recorded where the work lives.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import httpx
import msgspec
import uvicorn
import zmq.asyncio
from websockets.asyncio.client import connect

from dpserve.router.app import RouterSettings, create_app, server_config
from dpserve.router.tenants import TenantKey
from tests.polling import until
from tests.stub_replica import StubReplica
from tests.unit.test_router_images import BODY, FAST, GEN, _apps
from tests.unit.test_router_videos import SLOW, routers, stubs
from tests.workers import free_port

T = TypeVar("T")
A1, A2, B1, ROOT = "sk-team-a-one", "sk-team-a-two", "sk-team-b-one", "sk-admin"
KEYS: dict[str, Any] = {
    "api_keys": (TenantKey(A1, "team-a"), TenantKey(A2, "team-a"), TenantKey(B1, "team-b")),
    "admin_keys": (TenantKey(ROOT, "ops"),),
}


def _as(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _run(scenario: Callable[[], Coroutine[Any, Any, T]]) -> T:
    return asyncio.run(scenario())


def _never_made(job_id: str) -> str:
    """An id of the same replica and boot whose random part was never given out."""
    return re.sub(r"^video_[0-9a-f]{32}", "video_" + "0" * 32, job_id)


def _same_404(theirs: httpx.Response, unknown: httpx.Response, their_id: str, new_id: str) -> None:
    """Another tenant's id and a never-made one get one answer, the ids aside."""
    assert theirs.status_code == unknown.status_code == 404, (theirs.text, unknown.text)
    assert theirs.headers["content-type"] == unknown.headers["content-type"]
    shown, expected = theirs.json(), unknown.json()
    shown.pop("id"), expected.pop("id")  # each request's own id
    shown["error"]["message"] = shown["error"]["message"].replace(their_id, new_id)
    assert shown == expected


# ---------------------------------------------------------------- video jobs


def test_a_video_job_is_its_tenants_on_every_router() -> None:
    async def scenario() -> None:
        ctx = zmq.asyncio.Context()
        async with stubs(ctx, 2) as replicas, routers(replicas, 2, **KEYS) as made:
            (_, one), (_, two) = made
            answer = await one.post("/v1/videos", json=SLOW, headers=_as(A1))
            assert answer.status_code == 200, answer.text
            job_id = answer.json()["id"]
            unknown_id = _never_made(job_id)
            for http in (one, two):  # the router that placed it, and one that did not
                listed = await http.get("/v1/videos", headers=_as(B1))
                assert listed.status_code == 200 and listed.json()["data"] == []
                for method, tail in (("GET", ""), ("GET", "/content"), ("DELETE", "")):
                    theirs = await http.request(
                        method, f"/v1/videos/{job_id}{tail}", headers=_as(B1)
                    )
                    unknown = await http.request(
                        method, f"/v1/videos/{unknown_id}{tail}", headers=_as(B1)
                    )
                    _same_404(theirs, unknown, job_id, unknown_id)
                # the tenant's other key, and an admin, see it
                for key in (A2, ROOT):
                    shown = await http.get("/v1/videos", headers=_as(key))
                    assert [j["id"] for j in shown.json()["data"]] == [job_id]
                    got = await http.get(f"/v1/videos/{job_id}", headers=_as(key))
                    assert got.status_code == 200 and got.json()["prompt"] == SLOW["prompt"]
            # team-b's delete left it running
            assert any(r.job(job_id) for r in replicas)
            assert all(not r.video_cancelled for r in replicas)
            deleted = await two.delete(f"/v1/videos/{job_id}", headers=_as(A2))
            assert deleted.status_code == 200 and deleted.json()["deleted"] is True
        ctx.term()

    _run(scenario)


def test_a_finished_videos_content_and_a_rerun_stay_its_tenants() -> None:
    async def scenario() -> None:
        ctx = zmq.asyncio.Context()
        async with stubs(ctx, 2) as replicas, routers(replicas, **KEYS) as [(_, http)]:
            body = {**SLOW, "num_inference_steps": 40}  # 0.8 s: lost while it runs
            answer = await http.post("/v1/videos", json=body, headers=_as(A1))
            job_id = answer.json()["id"]
            holder = next(r for r in replicas if r.job(job_id) is not None)
            holder.reboot()  # the router runs it again on the other replica
            other = next(r for r in replicas if r is not holder)
            await until(lambda: other.job(job_id) is not None, 10)
            assert other.video_submits[-1][0].tenant == "team-a"
            await until(lambda: other.job(job_id).status == "completed", 10)  # type: ignore[union-attr]
            theirs = await http.get(f"/v1/videos/{job_id}/content", headers=_as(B1))
            assert theirs.status_code == 404
            mine = await http.get(f"/v1/videos/{job_id}/content", headers=_as(A2))
            assert mine.status_code == 200 and mine.headers["content-type"] == "video/mp4"
        ctx.term()

    _run(scenario)


# ---------------------------------------------------------------- cancel by id


def test_cancel_by_id_reaches_only_its_tenants_request_through_any_router() -> None:
    async def scenario() -> None:
        ctx = zmq.asyncio.Context()
        stub = StubReplica(ctx, step_s=0.3)
        try:
            async with _apps(stub, count=2, **KEYS) as [(_, one), (_, two)]:
                body = {**BODY, "num_inference_steps": 20}
                headers = {**_as(A1), "X-Request-Id": "a-request"}
                waiting = asyncio.create_task(one.post(GEN, json=body, headers=headers))
                await until(lambda: bool(stub.received), 10)
                for http in (one, two):  # held by router one; two asks the replicas
                    theirs = await http.post("/v1/images/a-request/cancel", headers=_as(B1))
                    unknown = await http.post("/v1/images/no-request/cancel", headers=_as(B1))
                    _same_404(theirs, unknown, "a-request", "no-request")
                assert not stub.cancelled and not waiting.done()
                mine = await two.post("/v1/images/a-request/cancel", headers=_as(A2))
                assert mine.status_code == 200 and mine.json()["stage"] == "running_at_replica"
                assert (await waiting).status_code == 499
                # finished: "too late" for its tenant, unknown to the other
                late = await one.post("/v1/images/a-request/cancel", headers=_as(A2))
                assert late.status_code == 409
                theirs = await one.post("/v1/images/a-request/cancel", headers=_as(B1))
                assert theirs.status_code == 404
        finally:
            await stub.close()
            ctx.term()

    _run(scenario)


# ---------------------------------------------------------------- stored images


def test_a_stored_image_opens_by_link_or_for_its_tenant(tmp_path: Path) -> None:
    async def scenario() -> None:
        ctx = zmq.asyncio.Context()
        stub = StubReplica(ctx)
        try:
            settings = {**KEYS, "output_dir": tmp_path}
            async with _apps(stub, **settings) as [(_, http)]:
                made = await http.post(
                    GEN, json={**BODY, "response_format": "url"}, headers=_as(A1)
                )
                assert made.status_code == 200, made.text
                path = httpx.URL(made.json()["data"][0]["url"]).path
                name = path.rsplit("/", 1)[1]
                assert ".team-a." in name and (tmp_path / name).is_file()  # on disk, with it
                unknown_path = path.replace(name[:32], "0" * 32)
                assert (await http.get(path)).status_code == 200  # the link alone: served
                # a key that matches none counts as none (the route needs none)
                assert (await http.get(path, headers=_as("sk-nobody"))).status_code == 200
                for key in (A2, ROOT):
                    assert (await http.get(path, headers=_as(key))).status_code == 200
                theirs = await http.get(path, headers=_as(B1))
                unknown = await http.get(unknown_path, headers=_as(B1))
                _same_404(theirs, unknown, name, unknown_path.rsplit("/", 1)[1])
        finally:
            await stub.close()
            ctx.term()

    _run(scenario)


# ---------------------------------------------------------------- realtime sessions


@contextlib.asynccontextmanager
async def _serving(settings: RouterSettings) -> AsyncIterator[str]:
    """The router under uvicorn on a free port: a real WebSocket needs a real server."""
    port = free_port()
    app = create_app(settings)
    server = uvicorn.Server(server_config(app, "127.0.0.1", port, settings))
    task = asyncio.create_task(server.serve())
    while not server.started:
        assert not task.done(), "uvicorn did not start"
        await asyncio.sleep(0.02)
    try:
        await until(lambda: bool(app.state.running.pool.serving()), 10)
        yield f"ws://127.0.0.1:{port}/v1/realtime_video/generate"
    finally:
        server.should_exit = True
        await task


async def _ask(url: str, key: str, message: dict[str, Any]) -> dict[str, Any]:
    """One message on a new socket, and the first answer."""
    async with connect(url, additional_headers=_as(key)) as ws:
        await ws.send(msgspec.msgpack.encode(message))
        answer = msgspec.msgpack.decode(await asyncio.wait_for(ws.recv(), 10))
        assert isinstance(answer, dict)
        return answer


def test_a_realtime_session_resumes_only_for_its_tenant() -> None:
    async def scenario() -> None:
        ctx = zmq.asyncio.Context()
        stub = StubReplica(ctx)
        try:
            settings = RouterSettings(workers=(stub.endpoint,), pool=FAST, **KEYS)
            async with (
                _serving(settings) as url,
                connect(url, additional_headers=_as(A1)) as ws,
            ):
                await ws.send(msgspec.msgpack.encode({"type": "init", "prompt": "a kite"}))
                ack = msgspec.msgpack.decode(await asyncio.wait_for(ws.recv(), 10))
                assert ack["type"] == "init_ack", ack
                sid = ack["session_id"]
                assert stub.sessions[sid].tenant == "team-a"
                unknown_sid = "0" * 32 + sid[32:]
                theirs = await _ask(url, B1, {"type": "resume", "session_id": sid})
                unknown = await _ask(url, B1, {"type": "resume", "session_id": unknown_sid})
                assert theirs["type"] == "error", theirs
                assert theirs == {
                    **unknown,
                    "content": unknown["content"].replace(unknown_sid, sid),
                }
                assert stub.sessions[sid].epoch == 0  # untouched: still the first socket's
                mine = await _ask(url, A2, {"type": "resume", "session_id": sid})
                assert mine["type"] == "init_ack" and mine["session_id"] == sid
        finally:
            await stub.close()
            ctx.term()

    _run(scenario)
