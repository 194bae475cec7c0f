"""The driver's ingress on its own (this test plays the gang loop): edits and previews
are checked before they queue, and a cancel by id from any client."""

from __future__ import annotations

import io
from collections.abc import Iterator

import pytest
from PIL import Image

from dpserve.client import ReplicaClient, ReplicaTimeout
from dpserve.contract import protocol as p
from dpserve.contract import validation as pv
from dpserve.worker.commands import GangStatus
from dpserve.worker.driver import Driver
from dpserve.worker.edit import EditSupport
from dpserve.worker.features import Features
from tests.workers import free_port

BODY = {"prompt": "x", "width": 64, "height": 64, "num_inference_steps": 2, "seed": 1}
NO_EDITS = Features(EditSupport(edits=False, inpainting=False, max_images=0), partial_images=0)
FLUX = Features(EditSupport(edits=True, inpainting=True, max_images=1), partial_images=3)


def _front(features: Features) -> Driver:
    url = f"tcp://127.0.0.1:{free_port()}"
    return Driver(url, 0, pv.Limits(), GangStatus(), 8, 120.0, 2, features=features)


@pytest.fixture()
def flux() -> Iterator[Driver]:
    front = _front(FLUX)
    front.start()
    try:
        yield front
    finally:
        front.close()


def _png(size: tuple[int, int], mode: str = "RGB") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size).save(buf, format="PNG")
    return buf.getvalue()


def _edit(images: int, mask: bool = False, **fields: object) -> dict[str, object]:
    edit = {"images": list(range(images)), "mask": images if mask else None}
    return {**BODY, **fields, "edit": edit}


def _refused(client: ReplicaClient, body: object, blobs: list[bytes]) -> p.RequestError:
    with pytest.raises(p.RequestError) as err:
        client.call(p.GENERATE, body, blobs=blobs)
    return err.value


def test_bad_uploads_are_refused_naming_the_field_before_they_queue(flux: Driver) -> None:
    with ReplicaClient(flux.endpoint, timeout_s=5) as client:
        mask = _refused(client, _edit(1, mask=True), [_png((64, 64)), _png((32, 32), "L")])
        assert (mask.code, mask.fields[0].field) == (p.INVALID_REQUEST, "mask")
        assert "32x32 but image[0] is 64x64" in str(mask)
        junk = _refused(client, _edit(1), [b"not an image"])
        assert junk.fields[0].field == "image[0]" and "not a readable image" in str(junk)
        huge = _refused(client, _edit(1), [_png((5000, 4000), "L")])
        assert huge.fields[0].field == "image[0]" and "4096x4096" in str(huge)
        many = _refused(client, _edit(2), [_png((64, 64)), _png((64, 64))])
        assert many.code == p.UNSUPPORTED and "at most 1 image" in str(many)
        missing = _refused(client, _edit(1), [])
        assert missing.code == p.INVALID_REQUEST
        assert flux.scheduler.work.qsize() == 0
        client.send_raw(p.encode(p.GENERATE, "ok", _edit(1, mask=True), [_png((96, 64))] * 2))
        assert client.ping().queue_depth == 1
    [work] = flux.scheduler.next_batch(timeout=0)
    assert len(work.command.blobs) == 2  # the uploads travel to the gang
    params = work.command.batch[0].params
    assert (params.width, params.height) == (64, 64)  # given: kept
    flux.scheduler.finished()


def test_an_edit_without_a_size_takes_its_first_images(flux: Driver) -> None:
    body = {k: v for k, v in _edit(1).items() if k not in ("width", "height")}
    with ReplicaClient(flux.endpoint, timeout_s=5) as client:
        client.send_raw(p.encode(p.GENERATE, "sized", body, [_png((100, 70))]))
        assert client.ping().queue_depth == 1
    [work] = flux.scheduler.next_batch(timeout=0)
    params = work.command.batch[0].params
    assert (params.width, params.height) == (96, 64)
    flux.scheduler.finished()


def test_what_the_model_cannot_do_is_unsupported_before_it_queues() -> None:
    front = _front(NO_EDITS)
    front.start()
    try:
        with ReplicaClient(front.endpoint, timeout_s=5) as client:
            edit = _refused(client, _edit(1), [_png((64, 64))])
            assert edit.code == p.UNSUPPORTED and edit.status == 400
            previews = _refused(client, {**BODY, "partial_images": 2}, [])
            assert previews.code == p.UNSUPPORTED
            assert previews.fields[0].field == "partial_images"
            assert front.scheduler.work.qsize() == 0
    finally:
        front.close()


def _cancel_any(client: ReplicaClient, request_id: str) -> p.CancelResult:
    reply = client.call(p.CANCEL, p.CancelRequest(request_id=request_id, any_client=True))
    result: p.CancelResult = reply.body_as(p.CancelResult)
    assert result.request_id == request_id
    return result


def test_a_cancel_from_any_client_finds_queued_and_running_work(flux: Driver) -> None:
    with (
        ReplicaClient(flux.endpoint, timeout_s=5) as owner,
        ReplicaClient(flux.endpoint, timeout_s=5) as other,
    ):
        for rid in ("run", "wait", "stay"):
            owner.send_raw(p.encode(p.GENERATE, rid, BODY))
        assert owner.ping().queue_depth == 3
        [running] = flux.scheduler.next_batch(timeout=0)
        assert running.command.id == "run"
        assert _cancel_any(other, "wait").found == p.CANCEL_QUEUED
        gone = owner.recv()  # answered to the request's own sender
        assert (gone.id, p.decode_error(gone).code) == ("wait", p.CANCELLED)
        assert _cancel_any(other, "run").found == p.CANCEL_RUNNING
        halt = flux.scheduler.halt()
        assert halt is not None and halt.code == p.CANCELLED  # the gang stops at its next step
        flux.scheduler.finished()
        assert _cancel_any(other, "run").found == p.CANCEL_NOT_FOUND
        assert _cancel_any(other, "nobody").found == p.CANCEL_NOT_FOUND
        with pytest.raises(ReplicaTimeout):
            other.recv(timeout_s=0.2)  # nothing else for the canceller
    [left] = flux.scheduler.next_batch(timeout=0)
    assert left.command.id == "stay"
    flux.scheduler.finished()
