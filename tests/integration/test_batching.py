"""Dynamic batching on real replicas (tiny model, --max-batch 4): compatible queued
requests run as one pipeline call, each answered with its own images; the bytes repeat
for the same batch, on one rank and on a CFG-parallel gang; a cancel reaches a request
inside a batch, and stops the gang only when it reaches every request of it."""

from __future__ import annotations

import io
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from dpserve.client import ReplicaClient
from dpserve.contract import protocol as p
from tests.workers import WorkerProcess, until_denoising

pytestmark = pytest.mark.gang

# Another size: never batched with the others. It runs first, alone, while they queue.
BLOCKER = dict(prompt="a wide one", width=128, height=64, num_inference_steps=12, seed=1)
TRUE_CFG = dict(width=64, height=64, num_inference_steps=4, true_cfg_scale=4.0)
# Compatible (same size, steps and true CFG), 1 + 2 + 1 images: one full batch of 4.
BATCH = {
    "fox": dict(prompt="a red fox", negative_prompt="blurry", seed=7, **TRUE_CFG),
    "owls": dict(prompt="two owls", negative_prompt="dark", n=2, seed=[8, 9], **TRUE_CFG),
    "sea": dict(prompt="the sea", negative_prompt="blurry", seed=10, output_format="jpeg",
                **TRUE_CFG),
}  # fmt: skip
LONG = dict(width=128, height=128, num_inference_steps=80)
PAIR = {
    "doomed": dict(prompt="a castle", seed=3, **LONG),
    "kept": dict(prompt="a boat", seed=4, **LONG),
}
QUICK = dict(prompt="a quick one", width=64, height=64, num_inference_steps=2, seed=6)


@pytest.fixture(scope="module")
def one_rank(tiny_model: Path) -> Iterator[WorkerProcess]:
    with WorkerProcess(tiny_model, "--max-batch", "4") as worker:
        yield worker


@pytest.fixture(scope="module")
def cfg_gang(tiny_model: Path) -> Iterator[WorkerProcess]:
    with WorkerProcess(tiny_model, "--max-batch", "4", "--cfg", "2") as worker:
        yield worker


def _send(client: ReplicaClient, requests: dict[str, dict[str, Any]]) -> None:
    client.send_raw(p.encode(p.GENERATE, "blocker", BLOCKER))
    for request_id, body in requests.items():
        client.send_raw(p.encode(p.GENERATE, request_id, body))


def _replies(client: ReplicaClient, count: int) -> dict[str, p.Message]:
    return {m.id: m for m in (client.recv() for _ in range(count))}


def _results(replies: dict[str, p.Message]) -> dict[str, tuple[p.GenerateResult, list[bytes]]]:
    return {
        request_id: (m.body_as(p.GenerateResult), list(m.blobs))
        for request_id, m in replies.items()
        if request_id != "blocker"
    }


def _batched(worker: WorkerProcess) -> dict[str, tuple[p.GenerateResult, list[bytes]]]:
    with worker.client(timeout_s=120) as client:
        _send(client, BATCH)
        return _results(_replies(client, 1 + len(BATCH)))


def _psnr(a: bytes, b: bytes) -> float:
    x, y = (np.asarray(Image.open(io.BytesIO(f)).convert("RGB"), np.float64) for f in (a, b))
    mse = float(((x - y) ** 2).mean())
    return float("inf") if mse == 0 else 10 * np.log10(255**2 / mse)


def test_compatible_requests_share_one_call_and_repeat_their_bytes(
    one_rank: WorkerProcess, cfg_gang: WorkerProcess
) -> None:
    with one_rank.client() as client:
        assert client.ping().max_batch == 4  # what the router sizes its cap by
    first = _batched(one_rank)
    # One pipeline call: one inference time; each request its own images, seeds, queue time.
    assert len({r.inference_time_s for r, _ in first.values()}) == 1
    assert {k: [m.seed for m in r.images] for k, (r, _) in first.items()} == {
        "fox": [7],
        "owls": [8, 9],
        "sea": [10],
    }
    assert first["sea"][1][0].startswith(b"\xff\xd8") and first["fox"][1][0].startswith(b"\x89PNG")
    assert len({f for _, files in first.values() for f in files}) == 4  # four images
    # The same batch again, and on a CFG-parallel gang (true CFG split over two ranks).
    again, split = _batched(one_rank), _batched(cfg_gang)
    for request_id, (_, files) in first.items():
        assert again[request_id][1] == files, request_id
        assert split[request_id][1] == files, request_id
    # Alone (nothing else queued: no batch) an image is close to, not always equal to,
    # its batched self: batched matmuls round differently (docs/worker.md).
    with one_rank.client(timeout_s=60) as client:
        psnr = [
            _psnr(batched, alone)
            for request_id, body in BATCH.items()
            if body.get("output_format") is None  # lossless only
            for batched, alone in zip(first[request_id][1], client.generate(**body)[1], strict=True)
        ]
    print(f"\n[batched vs alone] PSNR per image: {[round(v, 1) for v in psnr]}")
    assert min(psnr) > 40


def test_a_cancel_reaches_a_request_inside_a_batch(one_rank: WorkerProcess) -> None:
    with one_rank.client(timeout_s=120) as client, one_rank.client() as pinger:
        _send(client, PAIR)
        _replies(client, 1)  # the blocker
        reference = _results(_replies(client, 2))  # the pair, uncancelled: one batch
        full = reference["kept"][0].inference_time_s
        assert reference["doomed"][0].inference_time_s == reference["kept"][0].inference_time_s

        # One of the two cancelled: answered at its next step; the other finishes.
        _send(client, PAIR)
        _replies(client, 1)
        until_denoising(pinger)  # the pair's
        cancelled_at = time.monotonic()
        client.send_raw(p.encode(p.CANCEL, "c1", p.CancelRequest(request_id="doomed")))
        doomed = client.recv()
        answered = time.monotonic() - cancelled_at
        error = p.decode_error(doomed)
        assert (doomed.id, error.code) == ("doomed", p.CANCELLED)
        assert "dropped from its batch" in str(error)
        kept = client.recv()
        assert kept.id == "kept" and kept.kind == p.RESULT
        # Its image is what it gets in a batch of the same composition; the other's
        # was computed to the end and discarded.
        assert list(kept.blobs) == reference["kept"][1]
        print(f"\n[cancel one of two] answered {answered:.2f}s after the cancel; "
              f"the batch takes {full:.2f}s")  # fmt: skip
        assert answered < 0.5 * full

        # Both cancelled: the whole gang stops, and serves the next request at once.
        _send(client, PAIR)
        _replies(client, 1)
        started = time.monotonic()  # the pair's batch starts
        until_denoising(pinger)
        for request_id in PAIR:
            cancel = p.CancelRequest(request_id=request_id)
            client.send_raw(p.encode(p.CANCEL, f"c-{request_id}", cancel))
        stopped = _replies(client, 2)
        assert {k: p.decode_error(m).code for k, m in stopped.items()} == {
            "doomed": p.CANCELLED,
            "kept": p.CANCELLED,
        }
        _, (png,) = client.generate(**QUICK)
        freed = time.monotonic() - started
        assert png.startswith(b"\x89PNG") and client.ping().queue_depth == 0
    print(f"\n[cancel both] the next request done {freed:.2f}s after the pair started; "
          f"the pair takes {full:.2f}s")  # fmt: skip
    assert freed < 0.7 * full
