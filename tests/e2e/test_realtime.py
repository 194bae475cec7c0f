"""Realtime sessions through real routers in front of real replicas (issue 6).

Two replicas behind a router. Every frame names the replica that rendered it,
so the tests check placement by what comes back, not by what the router says.
"""

from __future__ import annotations

import io
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from PIL import Image

from dpserve.router.policies import hrw_order
from dpserve.router.sessions import session_owner
from tests.polling import eventually
from tests.realtime_client import RealtimeSocket
from tests.servers import RouterProcess
from tests.workers import WorkerProcess

pytestmark = pytest.mark.e2e

MAX_SESSIONS = 4
IDLE_S = 4
INIT = {"prompt": "a paper boat", "size": "64x64", "num_inference_steps": 3, "mode": "step"}


def _worker(model: Path, replica: int) -> WorkerProcess:
    args = ["--replica", str(replica), "--max-sessions", str(MAX_SESSIONS)]
    return WorkerProcess(model, *args, "--session-idle-timeout", str(IDLE_S))


@pytest.fixture(scope="module")
def workers(tiny_model: Path) -> Iterator[list[WorkerProcess]]:
    procs = [_worker(tiny_model, r) for r in range(2)]
    try:
        yield procs
    finally:
        for proc in procs:
            proc.kill()


@pytest.fixture(scope="module")
def router(workers: list[WorkerProcess]) -> Iterator[RouterProcess]:
    with RouterProcess([w.endpoint for w in workers], "--request-timeout", "60") as proc:
        _all_serving(proc, len(workers))
        yield proc


@pytest.fixture(autouse=True)
def _no_session_left(workers: list[WorkerProcess]) -> Iterator[None]:
    yield
    for worker in workers:
        if worker.proc.poll() is None:
            eventually(lambda w=worker: _sessions(w) == 0, 20, "the test's sessions to be released")


def _all_serving(router: RouterProcess, n: int) -> None:
    def serving() -> bool:
        states = router.http.get("/health/replicas").json()["replicas"]
        return sum(r["state"] == "serving" for r in states) == n

    eventually(serving, 60, f"{n} serving replicas")


def _sessions(worker: WorkerProcess) -> int:
    with worker.client(timeout_s=5) as client:
        return client.ping().sessions


def _replica_of(session_id: str, workers: list[WorkerProcess]) -> int:
    owner = session_owner(session_id)
    return next(i for i, w in enumerate(workers) if w.endpoint == owner)


def test_sessions_spread_and_every_message_reaches_the_owner(
    router: RouterProcess, workers: list[WorkerProcess]
) -> None:
    sockets = [RealtimeSocket(router.url) for _ in range(6)]
    try:
        owners = []
        for n, sock in enumerate(sockets):
            fmt = "jpeg" if n == 0 else "png"
            ack, first = sock.init(**INIT, seed=n, output_format=fmt)
            owner = _replica_of(ack["session_id"], workers)
            key = ack["session_id"].split(".")[0]
            preferred = hrw_order(key, [w.endpoint for w in workers])
            # HRW's choice, or the next one when the choice was full.
            assert workers[owner].endpoint in preferred
            assert ack["replica"] == first["replica"] == owner  # one type: the index
            assert first["content"].startswith(b"\xff\xd8" if n == 0 else b"\x89PNG")
            owners.append(owner)
        assert set(owners) == {0, 1}  # at most MAX_SESSIONS fit on one: both take some
        for sock, owner in zip(sockets, owners, strict=True):
            frames = [sock.step(), sock.step(prompt="a red kite"), sock.step()]
            assert [f["replica"] for f in frames] == [owner] * 3
            assert [f["index"] for f in frames] == [1, 2, 3]
        assert [_sessions(w) for w in workers] == [owners.count(0), owners.count(1)]
    finally:
        for sock in sockets:
            sock.close()


def test_another_router_routes_a_live_session_to_its_owner(
    router: RouterProcess, workers: list[WorkerProcess]
) -> None:
    with RealtimeSocket(router.url) as first:
        ack, _ = first.init(**INIT)
        owner = _replica_of(ack["session_id"], workers)
        first.step()
        # A router started on its own, sharing nothing with the first but the replicas.
        with RouterProcess([w.endpoint for w in reversed(workers)]) as other:
            _all_serving(other, 2)
            with RealtimeSocket(other.url) as second:
                resumed = second.resume(ack["session_id"], mode="step")
                assert resumed["replica"] == owner and resumed["frames"] == 2
                frame = second.step()
                assert (frame["replica"], frame["index"]) == (owner, 2)  # the state carried on
                # The first connection no longer drives the session, and is told why.
                first.send(type="step")
                error = first.expect("error")
                assert error["code"] == "session_moved" and "resumed" in error["content"]
                assert first.closed_code() == 4009
                assert _sessions(workers[owner]) == 1  # handing over released nothing
                assert second.step()["index"] == 3


def test_a_router_restart_leaves_the_session_to_resume(
    router: RouterProcess, workers: list[WorkerProcess]
) -> None:
    restarting = RouterProcess([w.endpoint for w in workers])
    _all_serving(restarting, 2)
    with RealtimeSocket(restarting.url) as sock:
        ack, _ = sock.init(**{**INIT, "mode": "stream", "fps": 20})
        sock.frames(2)
        owner = _replica_of(ack["session_id"], workers)
        restarting.proc.send_signal(signal.SIGTERM)
        assert sock.closed_code() == 1012  # "service restart": come back and resume
        restarting.close()
    assert _sessions(workers[owner]) == 1
    with RealtimeSocket(router.url) as again:
        assert again.resume(ack["session_id"], mode="step")["replica"] == owner
        assert again.step()["replica"] == owner


def test_adding_a_replica_does_not_move_live_sessions(
    router: RouterProcess, workers: list[WorkerProcess], tiny_model: Path
) -> None:
    third = _worker(tiny_model, 2)
    grown = [*workers, third]
    endpoints = [w.endpoint for w in grown]
    live: RealtimeSocket | None = None
    try:
        # A live session that HRW would place on the newcomer, were it new.
        for _ in range(40):
            sock = RealtimeSocket(router.url)
            ack, _ = sock.init(**INIT)
            if hrw_order(ack["session_id"].split(".")[0], endpoints)[0] == third.endpoint:
                live = sock
                break
            sock.close()
        assert live is not None and live.session_id is not None
        owner = _replica_of(live.session_id, workers)
        with RouterProcess(endpoints) as bigger:
            _all_serving(bigger, 3)
            with RealtimeSocket(bigger.url) as moved:
                assert moved.resume(live.session_id, mode="step")["replica"] == owner
                assert moved.step()["replica"] == owner
            # New sessions do use the newcomer.
            placed = set()
            for seed in range(12):
                with RealtimeSocket(bigger.url) as sock:
                    placed.add(sock.init(**INIT, seed=seed)[1]["replica"])
                if 2 in placed:
                    break
            assert 2 in placed
    finally:
        if live is not None:
            live.close()
        third.kill()


def test_stream_pacing_frame_limit_and_a_starting_image(router: RouterProcess) -> None:
    start = io.BytesIO()
    Image.new("RGB", (64, 64), (240, 200, 40)).save(start, format="PNG")
    with RealtimeSocket(router.url) as sock:
        ack, first = sock.init(
            **{**INIT, "mode": "stream", "fps": 5, "max_frames": 6, "first_frame": start.getvalue()}
        )
        began = time.monotonic()
        frames = sock.frames(5)
        took = time.monotonic() - began
        done = sock.expect("done")
        assert sock.closed_code() == 1000
    assert [f["index"] for f in (first, *frames)] == list(range(6))
    assert done["frames"] == 6 and done["session_id"] == ack["session_id"]
    assert took > 0.7, took  # 5 frames at 5 fps: about a second, not as fast as possible


def test_malformed_messages_close_the_socket_and_bad_values_do_not(
    router: RouterProcess,
) -> None:
    """A message that is not a client message's shape gets an error and close 1007; a
    well-formed one with bad values gets an error naming them, on a usable socket."""
    for bad, needle in (
        (b"\xc1\x00", "not valid msgpack"),
        ('{"type": "init"}', "binary msgpack"),
        (b"\x93\x01\x02\x03", "msgpack map"),
        (msgspec.msgpack.encode({"type": "init", "prompt": "x", "colour": "red"}), "colour"),
        (msgspec.msgpack.encode({"type": "prompt", "action_content": 42}), "action_content"),
    ):
        with RealtimeSocket(router.url) as sock:
            sock.send_raw(bad)
            assert needle in sock.expect("error")["content"]
            assert sock.closed_code() == 1007
    with RealtimeSocket(router.url) as sock:
        sock.send(type="prompt", action_content="too early")
        assert "send init (or resume) first" in sock.expect("error")["content"]
        sock.send(type="init", prompt="x", size="65x64", seed=-1)
        error = sock.expect("error")
        assert "size" in error["content"] and "seed" in error["content"]
        sock.send(type="resume", session_id="forged")
        assert "not a session id" in sock.expect("error")["content"]
        sock.init(**INIT)
        for message, needle in (
            ({"type": "teleport"}, "unknown message type"),
            ({"type": "init", "prompt": "again"}, "already carries a session"),
            ({"type": "video", "content": b"..."}, "video input is not supported"),
            ({"type": "prompt", "action_content": "x" * 20_000}, "action_content must be"),
        ):
            sock.send(**message)
            assert needle in sock.expect("error")["content"]
        assert sock.step()["index"] == 1


def test_close_and_idle_timeout_release_the_state(
    router: RouterProcess, workers: list[WorkerProcess]
) -> None:
    with RealtimeSocket(router.url) as sock:
        ack, _ = sock.init(**INIT)
        owner = workers[_replica_of(ack["session_id"], workers)]
        assert _sessions(owner) == 1
    eventually(lambda: _sessions(owner) == 0, 10, "closing the socket to release the session")

    with RealtimeSocket(router.url) as sock:
        ack, _ = sock.init(**INIT)
        owner = workers[_replica_of(ack["session_id"], workers)]
        sock.send(type="close")
        assert sock.closed_code() == 1000  # a close frame, not a dropped connection (1006)
        eventually(lambda: _sessions(owner) == 0, 10, "a close message to release the session")
    with RealtimeSocket(router.url) as sock:
        sock.send(type="close")  # before any init: nothing to release, a normal closure too
        assert sock.closed_code() == 1000

    with RealtimeSocket(router.url) as idle:
        ack, _ = idle.init(**INIT)
        owner = workers[_replica_of(ack["session_id"], workers)]
        assert _sessions(owner) == 1
        eventually(lambda: _sessions(owner) == 0, IDLE_S + 10, "the idle timeout")
        idle.send(type="step")
        error = idle.expect("error")
        assert error["code"] == "session_lost"
        assert f"expired after {IDLE_S}s idle" in error["content"]
        assert idle.closed_code() == 1011


def test_all_replicas_full_is_a_clear_error(router: RouterProcess) -> None:
    sockets = [RealtimeSocket(router.url) for _ in range(2 * MAX_SESSIONS)]
    try:
        for n, sock in enumerate(sockets):
            sock.init(**INIT, seed=n)
        with RealtimeSocket(router.url) as extra:
            extra.send(type="init", **INIT)
            error = extra.expect("error")
            assert error["code"] == "overloaded"
            full = f"all 2 serving replicas hold their maximum of {MAX_SESSIONS}"
            assert full in error["content"]
            sockets.pop().close()  # one leaves: the same socket can open a session now
            eventually(lambda: _try_init(extra), 20, "a free session slot")
    finally:
        for sock in sockets:
            sock.close()


def _try_init(sock: RealtimeSocket) -> bool:
    sock.send(type="init", **INIT)
    reply = sock.recv()
    if reply["type"] == "error":
        return False
    assert reply["type"] == "init_ack"
    sock.expect("frame")
    return True


def test_killing_the_owner_ends_its_sessions_while_others_continue(
    router: RouterProcess, workers: list[WorkerProcess]
) -> None:
    """Last in this module: it kills a replica."""
    stream = {**INIT, "mode": "stream", "fps": 10}
    sockets: dict[int, RealtimeSocket] = {}
    try:
        for _ in range(20):
            sock = RealtimeSocket(router.url)
            ack, _ = sock.init(**stream)
            owner = _replica_of(ack["session_id"], workers)
            if owner in sockets:
                sock.close()
                continue
            sockets[owner] = sock
            if len(sockets) == 2:
                break
        assert set(sockets) == {0, 1}
        workers[0].kill()
        error = sockets[0].recv(30)
        while error["type"] == "frame":  # frames already on their way come first
            error = sockets[0].recv(30)
        assert error["code"] == "session_lost" and "state was lost" in error["content"]
        assert sockets[0].closed_code() == 1011
        survivors = sockets[1].frames(5)
        assert {f["replica"] for f in survivors} == {1}
        # Its id still names the dead owner: a resume is refused clearly, not rerouted.
        assert sockets[0].session_id is not None
        with RealtimeSocket(router.url) as again:
            again.send(type="resume", session_id=sockets[0].session_id)
            error = again.expect("error")
            assert error["code"] == "session_lost" and "open a new session" in error["content"]
    finally:
        for sock in sockets.values():
            sock.close()
