"""The replica's side of ownership (docs/tenants.md, "Ownership"): the tenant is recorded
with a video job, a generation and a session, and every ask that names a scope finds
its own tenant's work only, answered for another tenant's as for an unknown id. The
wire's new fields are optional: an older router's messages read as before."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import torch

from dpserve.client import ReplicaClient
from dpserve.contract import protocol as p
from dpserve.contract import realtime as rt
from dpserve.contract import validation as pv
from dpserve.contract import video as v
from dpserve.contract.owners import may_see
from dpserve.worker.batch import Batching
from dpserve.worker.commands import GangCommand, GangStatus, Generation
from dpserve.worker.driver import Driver
from dpserve.worker.driver.outbox import Client
from dpserve.worker.driver.work_queue import Work, WorkQueue
from dpserve.worker.sessions import Session, SessionHost, SessionLimits
from tests.unit.test_batching import BASE
from tests.unit.test_video_book import JOB, Clock, _book, _done, _params
from tests.workers import free_port


def test_the_rule() -> None:
    assert may_see(None, "team-a") and may_see(None, "") and may_see("team-a", "team-a")
    assert not may_see("team-b", "team-a") and not may_see("team-a", "")


def test_the_book_answers_another_tenant_as_for_an_unknown_job(tmp_path: Path) -> None:
    book = _book(tmp_path, Clock())
    book.submit(JOB, _params(), created_at=1, attempt=1, tenant="team-a")
    book.answer(_done(JOB))
    unknown = JOB.replace(JOB[6:38], "0" * 32)
    for act in (
        lambda job_id: book.get(job_id, "team-b"),
        lambda job_id: book.content(job_id, v.VIDEO_VARIANT, "team-b"),
        lambda job_id: book.delete(job_id, "team-b"),
    ):
        with pytest.raises(p.RequestError) as theirs:
            act(JOB)
        with pytest.raises(p.RequestError) as never:
            act(unknown)
        assert str(theirs.value).replace(JOB, unknown) == str(never.value)
        assert theirs.value.code == p.NOT_FOUND
    assert book.list("team-b").jobs == [] and len(book.list("team-a").jobs) == 1
    assert book.get(JOB, "team-a").tenant == "team-a" and book.get(JOB).tenant == "team-a"
    assert book.delete(JOB, "team-a").id == JOB


def _generation(request_id: str, tenant: str) -> Work:
    batch = [Generation(id=request_id, params=BASE)]
    command = GangCommand(kind=p.GENERATE, id=request_id, batch=batch)
    return Work(Client(b"router"), command, 0.0, tenant=tenant)


def test_a_scoped_cancel_reaches_its_tenants_generation_only() -> None:
    queue = WorkQueue(16, Batching(1, 0.0))
    queue.put_nowait(_generation("r1", "team-a"))
    assert queue.cancel("r1", None, "team-b") == ([], p.CANCEL_NOT_FOUND)
    taken, found = queue.cancel("r1", None, "team-a")
    assert found == p.CANCEL_QUEUED and [w.command.id for w in taken] == ["r1"]
    queue.put_nowait(_generation("r2", "team-a"))
    assert queue.cancel("r2", None)[1] == p.CANCEL_QUEUED  # unscoped: an admin's


def test_a_session_resumes_for_its_tenant_only() -> None:
    host = SessionHost(None, {}, {}, SessionLimits(), lambda *_: [])  # type: ignore[arg-type]
    params = rt.SessionParams(prompt="a kite", seed=1)
    host.sessions["s1"] = Session(
        params, "a kite", torch.zeros(1), torch.Generator(), 0.0, tenant="team-a"
    )
    with pytest.raises(p.RequestError) as theirs:
        host.resume("s1", "team-b")
    with pytest.raises(p.RequestError) as never:
        host.resume("s0", "team-b")
    assert str(theirs.value).replace("s1", "s0") == str(never.value)
    assert host.sessions["s1"].epoch == 0
    assert host.resume("s1", "team-a").epoch == 1 and host.resume("s1").epoch == 2


def test_an_older_senders_messages_read_as_before_and_a_bad_tenant_is_a_bad_frame() -> None:
    old = msgspec.msgpack.encode({"action": "get", "job_id": JOB})
    request = msgspec.msgpack.decode(old, type=v.VideoRequest)
    assert (request.tenant, request.scope) == ("", None)  # unowned, and sees all
    cancel = msgspec.msgpack.decode(
        msgspec.msgpack.encode({"request_id": "r"}), type=p.CancelRequest
    )
    assert cancel.scope is None
    frames = p.encode(p.GENERATE, "r1", {"prompt": "x"}, tenant="team-a")
    assert p.decode(frames).tenant == "team-a" and p.decode(p.encode(p.PING, "x")).tenant == ""
    header = msgspec.msgpack.encode({"v": 1, "id": "r2", "kind": p.GENERATE, "tenant": "t" * 64})
    with pytest.raises(p.ProtocolError) as bad:
        p.decode([header])
    assert bad.value.request_id == "r2"  # answered as a bad frame, never fatal


def test_the_drivers_ingress_records_the_headers_tenant_for_a_scoped_cancel() -> None:
    """The real driver's socket thread: the tenant a generation's header names goes
    with its work, and a cancel from another router scoped to another tenant misses it."""
    driver = Driver(f"tcp://127.0.0.1:{free_port()}", 0, pv.Limits(), GangStatus(), 8, 120.0, 2)
    driver.start()
    try:
        with (
            ReplicaClient(driver.endpoint, timeout_s=5) as owner,
            ReplicaClient(driver.endpoint, timeout_s=5) as other,
        ):
            body = {"prompt": "x", "width": 64, "height": 64, "num_inference_steps": 2, "seed": 1}
            owner.send_raw(p.encode(p.GENERATE, "r1", body, tenant="team-a"))
            assert owner.ping().queue_depth == 1

            def cancel(scope: str | None) -> str:
                asked = p.CancelRequest(request_id="r1", any_client=True, scope=scope)
                found: str = other.call(p.CANCEL, asked).body_as(p.CancelResult).found
                return found

            assert cancel("team-b") == p.CANCEL_NOT_FOUND
            assert owner.ping().queue_depth == 1  # still queued
            assert cancel("team-a") == p.CANCEL_QUEUED
            assert p.decode_error(owner.recv()).code == p.CANCELLED
    finally:
        driver.close()
