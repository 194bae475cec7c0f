"""Edits, previews and cancels through real worker processes: PARTIAL replies on the
wire before the result, a running request cancelled by id from another client, and a
CFG-parallel gang's edit with previews equal to one process's bytes."""

from __future__ import annotations

import io
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from PIL import Image

from dpserve.client import ReplicaClient
from dpserve.contract import protocol as p
from tests.integration.test_gang import CFG_REQUEST
from tests.polling import eventually
from tests.workers import WorkerProcess

pytestmark = pytest.mark.gang

# test_gang's true-CFG request, as an inpainting edit with previews.
CFG_EDIT = {**CFG_REQUEST, "partial_images": 2, "edit": {"images": [0], "mask": 1, "strength": 0.9}}


def _files() -> list[bytes]:
    image, mask = Image.new("RGB", (64, 64), (30, 140, 220)), Image.new("L", (64, 64), 0)
    mask.paste(255, (16, 16, 48, 48))
    out = []
    for img in (image, mask):
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        out.append(buf.getvalue())
    return out


@pytest.fixture(scope="module")
def single(tiny_model: Path) -> Iterator[WorkerProcess]:
    with WorkerProcess(tiny_model) as worker:
        yield worker


def _stream(client: ReplicaClient, rid: str, body: dict[str, object]) -> list[p.Message]:
    """Every reply to ``rid``, up to and including its final one."""
    client.send_raw(p.encode(p.GENERATE, rid, body, _files() if "edit" in body else ()))
    replies = [client.recv()]
    while replies[-1].kind == p.PARTIAL:
        replies.append(client.recv())
    assert all(r.id == rid for r in replies)
    return replies


def test_previews_stream_before_the_result(single: WorkerProcess) -> None:
    with single.client() as client:
        replies = _stream(client, "cfg", CFG_EDIT)
        assert [r.kind for r in replies] == [p.PARTIAL] * 4 + [p.RESULT]
        steps = [r.body_as(p.PartialImage).step for r in replies[:-1]]
        assert steps == sorted(steps) and steps[0] < steps[-1]
        plain = {k: v for k, v in CFG_EDIT.items() if k != "partial_images"}
        (alone,) = _stream(client, "plain", plain)
        assert alone.blobs == replies[-1].blobs


def test_a_running_request_is_cancelled_by_id_from_another_client(single: WorkerProcess) -> None:
    slow = {"prompt": "x", "width": 64, "height": 64, "num_inference_steps": 100, "seed": 1}
    with single.client() as owner, single.client() as other:
        owner.send_raw(p.encode(p.GENERATE, "slow", slow))
        owner.send_raw(p.encode(p.GENERATE, "next", {**slow, "num_inference_steps": 2}))
        eventually(lambda: other.ping().busy, timeout_s=10, what="the slow request to run")
        sent = time.monotonic()
        cancel = p.CancelRequest(request_id="slow", any_client=True)
        found = other.call(p.CANCEL, cancel).body_as(p.CancelResult)
        assert found.found == p.CANCEL_RUNNING
        stopped = owner.recv()
        assert (stopped.id, p.decode_error(stopped).code) == ("slow", p.CANCELLED)
        assert time.monotonic() - sent < 2  # at the next step, not after 100
        following = owner.recv()
        assert (following.id, following.kind) == ("next", p.RESULT)  # the queue moves on


def test_cfg_gang_edit_with_previews_equals_one_process(
    tiny_model: Path, single: WorkerProcess
) -> None:
    with single.client() as client:
        alone = _stream(client, "one", CFG_EDIT)
    with WorkerProcess(tiny_model, "--cfg", "2") as gang, gang.client() as client:
        paired = _stream(client, "two", CFG_EDIT)
        info = client.control("model_info")
    assert info["cfg_parallel"] == "split" and info["features"]["inpainting"] is True
    assert [r.kind for r in paired] == [r.kind for r in alone]
    assert [r.blobs for r in paired] == [r.blobs for r in alone]  # previews and images
