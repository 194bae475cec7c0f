"""Qwen-Image-Edit through the worker's ZMQ front: edits (the reference image encoded
by the VL encoder on the output rank, its hidden states relayed to the other ranks)
under ulysses2 and tp2 against one rank, within one grey level; previews under a split;
Edit-Plus with two references."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from dpserve.client import ReplicaClient
from dpserve.contract import protocol as p
from tests.integration.test_qwen_image_edit_parallel import reference_png
from tests.integration.test_qwen_image_worker import _close, _pixels
from tests.workers import WorkerProcess

pytestmark = pytest.mark.gang

REQUEST = dict(
    prompt="a red fox in snow",
    negative_prompt="ugly blurry",
    true_cfg_scale=4.0,
    num_inference_steps=2,
    seed=[21],
)
FILES = [reference_png(), reference_png((20, 40, 200))]


def _edit(client: ReplicaClient, rid: str, images: list[int], **fields: object) -> p.Message:
    body = {**REQUEST, **fields, "edit": {"images": images}}
    client.send_raw(p.encode(p.GENERATE, rid, body, FILES))
    reply = client.recv()
    assert reply.kind == p.RESULT, reply.body
    return reply


@pytest.fixture(scope="module")
def single(tiny_qwen_edit_model: Path) -> Iterator[WorkerProcess]:
    with WorkerProcess(tiny_qwen_edit_model) as w:
        yield w


LAYOUTS = {"tp2": ("--tp", "2"), "ulysses2": ("--sp", "2")}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def split(request: pytest.FixtureRequest, tiny_qwen_edit_model: Path) -> Iterator[WorkerProcess]:
    with WorkerProcess(tiny_qwen_edit_model, *LAYOUTS[request.param]) as w:
        yield w


def test_edits_match_one_rank(single: WorkerProcess, split: WorkerProcess) -> None:
    """The output takes the reference's size (64x48); a cfg-free edit and two images
    a call (n=2) too. The encoder lives on the output rank only."""
    for fields in ({}, {"negative_prompt": None, "true_cfg_scale": None}, {"n": 2, "seed": [3, 4]}):
        blobs = []
        for worker in (single, split):
            with worker.client() as client:
                blobs.append(_edit(client, "edit", [0], **fields).blobs)
        assert _pixels(blobs[0][0]).shape == (48, 64, 3)
        assert len(blobs[0]) == len(blobs[1]) == len(fields.get("seed", [0]))
        assert all(map(_close, *blobs)), fields
    with split.client() as c:
        info = c.control("model_info")
    encoders = [w["bytes"]["text_encoder"] for w in info["rank_weights"]]
    assert encoders[0] > 0 and encoders[1] == 0


def test_the_reference_image_reaches_the_split_replica(split: WorkerProcess) -> None:
    with split.client() as client:
        one, other = (_edit(client, f"ref{i}", [i]).blobs[0] for i in (0, 1))
    assert int(abs(_pixels(one) - _pixels(other)).max()) >= 3


def test_previews_of_an_edit_under_a_split(split: WorkerProcess) -> None:
    body = {**REQUEST, "num_inference_steps": 3, "partial_images": 2, "edit": {"images": [0]}}
    with split.client() as client:
        client.send_raw(p.encode(p.GENERATE, "previews", body, FILES))
        replies = [client.recv()]
        while replies[-1].kind == p.PARTIAL:
            replies.append(client.recv())
        assert [r.kind for r in replies] == [p.PARTIAL] * 2 + [p.RESULT], replies[-1].body
        previews = [r.body_as(p.PartialImage) for r in replies[:-1]]
        assert [(m.width, m.height) for m in previews] == [(64, 48)] * 2
        assert _pixels(replies[0].blobs[0]).shape == (48, 64, 3)
        plain = {k: v for k, v in body.items() if k != "partial_images"}
        client.send_raw(p.encode(p.GENERATE, "plain", plain, FILES))
        assert client.recv().blobs == replies[-1].blobs


def test_edit_plus_takes_two_references_under_ulysses2(tiny_qwen_edit_plus_model: Path) -> None:
    plain = {"negative_prompt": None, "true_cfg_scale": None}
    blobs = []
    for flags in ((), ("--sp", "2")):
        with WorkerProcess(tiny_qwen_edit_plus_model, *flags) as worker, worker.client() as c:
            blobs.append(_edit(c, "plus", [0, 1], **plain).blobs[0])
    assert _close(*blobs)


def test_a_request_without_an_image_is_refused_before_it_queues(single: WorkerProcess) -> None:
    with single.client() as client:
        client.send_raw(p.encode(p.GENERATE, "plain", REQUEST))
        reply = client.recv()
    assert reply.kind == p.ERROR
    error = reply.body_as(p.ErrorBody)
    assert error.code == p.UNSUPPORTED and "POST /v1/images/edits" in error.message
