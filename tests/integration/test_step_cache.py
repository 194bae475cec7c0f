"""Step caches on a real one-rank executor in process (the tiny Flux model), and the
ingress refusing a kind the replica does not offer. CFG-parallel: test_step_cache_gang.py."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from PIL import Image

from dpserve.client import ReplicaClient
from dpserve.config.worker import WorkerConfig
from dpserve.contract import protocol as p
from dpserve.contract import validation as pv
from dpserve.worker.commands import GangStatus
from dpserve.worker.driver import Driver
from dpserve.worker.edit import EditSupport
from dpserve.worker.features import Features
from dpserve.worker.step_cache import StepCaches
from tests.executors import one_rank_executors, reply_to
from tests.workers import free_port

torch = pytest.importorskip("torch")

from dpserve.worker.executor import Executor  # noqa: E402

BASE = dict(prompt="a red fox", width=64, height=64, num_inference_steps=8, seed=[5])
# On random weights the first block's residual changes by ~60 % a step, so Flux's usual
# thresholds skip nothing here; 1.0 skips about every other step.
SKIPPING = p.StepCache(type="first_block_cache", threshold=1.0)
OFF = p.StepCache(type="none")


@pytest.fixture(scope="module")
def executors(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Two executors on one one-rank gang: one whose service default is a skipping
    first-block-cache, one without a default."""
    plain = WorkerConfig(model=tiny_model, port=free_port(), device="cpu")
    cached = WorkerConfig(
        model=tiny_model,
        port=free_port(),
        device="cpu",
        step_cache="first_block_cache",
        step_cache_threshold=1.0,
    )
    with one_rank_executors((plain, cached), tmp_path_factory.mktemp("gang")) as built:
        yield built[0], built[1], plain


def _image(executor: Executor, **fields: Any) -> bytes:
    return reply_to(executor, {**BASE, **fields}).blobs[0]


def _psnr_db(a: bytes, b: bytes) -> float:
    x, y = (np.asarray(Image.open(io.BytesIO(i)), dtype=np.float64) / 255 for i in (a, b))
    mse = float(((x - y) ** 2).mean())
    return float("inf") if mse == 0 else 10 * np.log10(1 / mse)


def _hooks(executor: Executor) -> list[str]:
    """Diffusers hooks left on any module of the transformer."""
    return [
        f"{name}:{hook}"
        for name, module in executor.pipe.transformer.named_modules()
        for hook in getattr(getattr(module, "_diffusers_hook", None), "hooks", {})
    ]


def test_model_info_lists_the_offered_caches_and_the_default(executors: Any) -> None:
    plain, cached, _ = executors
    assert msgspec.to_builtins(plain.ops.info)["features"]["step_caches"] == {
        "first_block_cache": {"threshold": 0.08},
        "taylorseer": {"interval": 3},
    }
    assert msgspec.to_builtins(plain.ops.info)["features"]["step_cache_default"] is None
    default = msgspec.to_builtins(cached.ops.info)["features"]["step_cache_default"]
    assert default == {"type": "first_block_cache", "threshold": 1.0}


def test_each_cache_changes_the_image_a_little_and_leaves_nothing_behind(executors: Any) -> None:
    plain, _, _ = executors
    uncached = _image(plain)
    for cache in (SKIPPING, p.StepCache(type="taylorseer", interval=2)):
        first = _image(plain, step_cache=cache)
        assert first != uncached, cache  # it skipped work
        assert 20 < _psnr_db(first, uncached) < 80, cache  # close to the uncached image
        assert _image(plain, step_cache=cache) == first  # no state carried over
        assert _hooks(plain) == [] and not plain.pipe.transformer.is_cache_enabled
    assert _image(plain) == uncached


def test_the_service_default_applies_unless_a_request_turns_it_off(executors: Any) -> None:
    plain, cached, _ = executors
    assert _image(cached) == _image(plain, step_cache=SKIPPING)
    assert _image(cached, step_cache=OFF) == _image(plain)
    other = p.StepCache(type="taylorseer", interval=2)
    assert _image(cached, step_cache=other) == _image(plain, step_cache=other)


def test_layouts_and_compile_refuse_a_service_default_at_start(executors: Any) -> None:
    import dataclasses

    from dpserve.worker.boot import accel as _accel
    from dpserve.worker.parallel import ParallelUnsupported

    plain, _, config = executors
    tp = dataclasses.replace(config, tp=2, step_cache="taylorseer")
    with pytest.raises(ParallelUnsupported, match="--step-cache taylorseer: not under tensor"):
        _accel(tp, plain.pipe)
    both = dataclasses.replace(config, compile=True, step_cache="taylorseer")
    with pytest.raises(ParallelUnsupported, match="not with --compile"):
        _accel(both, plain.pipe)
    odd = dataclasses.replace(config, compile=True, compile_sizes=("72x64",))
    with pytest.raises(ParallelUnsupported, match="multiples of 16"):
        _accel(odd, plain.pipe)
    caches, compiler = _accel(dataclasses.replace(config, tp=2), plain.pipe)
    assert caches.offered == () and "tp=2" in str(caches.refusal) and compiler is None
    caches, compiler = _accel(dataclasses.replace(config, compile=True), plain.pipe)
    assert caches.offered == () and "--compile" in str(caches.refusal)
    from dpserve.worker.preview import output_size

    assert compiler is not None and compiler.sizes == (output_size(plain.pipe, {}),)


def test_the_ingress_refuses_a_cache_the_replica_lacks_before_it_queues() -> None:
    refusal = "not under tensor or sequence parallel (tp=2, sp=1)"
    features = Features(
        EditSupport(edits=False, inpainting=False, max_images=0),
        partial_images=0,
        step_caches=StepCaches((), refusal=refusal),
    )
    url = f"tcp://127.0.0.1:{free_port()}"
    front = Driver(url, 0, pv.Limits(), GangStatus(), 8, 120.0, 2, features=features)
    front.start()
    body = {"prompt": "x", "width": 64, "height": 64, "seed": 1}
    try:
        with ReplicaClient(front.endpoint, timeout_s=5) as client:
            with pytest.raises(p.RequestError) as err:
                client.call(p.GENERATE, {**body, "step_cache": "first_block_cache"})
            assert err.value.code == p.UNSUPPORTED and refusal in str(err.value)
            assert err.value.fields == [p.FieldError("step_cache", "must be none or left out")]
            assert front.scheduler.work.qsize() == 0
            client.send_raw(p.encode(p.GENERATE, "ok", {**body, "step_cache": "none"}))
            client.send_raw(p.encode(p.PING, "ping", {}))
            client.recv()  # the ping's answer: the generation before it was handled
            assert front.scheduler.work.qsize() == 1
    finally:
        front.close()


def test_each_cache_works_on_edits_and_inpainting(executors: Any) -> None:
    """Flux's image-to-image and inpainting pipelines enter no cache_context of their
    own; the hooks' state then lives in one context for the call (step_cache.applied)."""
    plain, cached, _ = executors
    source = io.BytesIO()
    Image.new("RGB", (64, 64), (200, 40, 40)).save(source, format="PNG")
    mask = io.BytesIO()
    Image.new("L", (64, 64), 255).save(mask, format="PNG")
    blobs = [source.getvalue(), mask.getvalue()]
    for edit in (p.EditInput(images=[0], strength=1.0), p.EditInput(images=[0], mask=1)):
        fields = {**BASE, "edit": edit}
        uncached = reply_to(plain, fields, blobs).blobs[0]
        for cache in (SKIPPING, p.StepCache(type="taylorseer", interval=2)):
            first = reply_to(plain, {**fields, "step_cache": cache}, blobs).blobs[0]
            assert first != uncached and _psnr_db(first, uncached) > 20, (edit, cache)
            assert reply_to(plain, {**fields, "step_cache": cache}, blobs).blobs[0] == first
            assert _hooks(plain) == []
        assert (
            reply_to(cached, fields, blobs).blobs[0]
            == reply_to(plain, {**fields, "step_cache": SKIPPING}, blobs).blobs[0]
        )
