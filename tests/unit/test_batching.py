"""Dynamic batching's pure parts: the compatibility rule, how the driver's queue gathers
a batch (and when it waits), and a batch's pipeline arguments."""

from __future__ import annotations

import threading
import time

import msgspec
import pytest

from dpserve.contract import protocol as p
from dpserve.contract.protocol import (
    EditInput,
    GenerateParams,
)
from dpserve.worker.batch import PER_IMAGE, Batching, compatible, split
from dpserve.worker.commands import GangCommand, Generation
from dpserve.worker.driver.outbox import Client
from dpserve.worker.driver.work_queue import Work, WorkQueue

BASE = GenerateParams(prompt="a fox", width=64, height=64, num_inference_steps=4, seed=[1])


def _params(**changes: object) -> GenerateParams:
    return msgspec.structs.replace(BASE, **changes)


def _gen(request_id: str, **changes: object) -> Work:
    params = _params(**changes)
    if params.seed is not None and len(params.seed) != params.n:
        params = msgspec.structs.replace(params, seed=list(range(params.n)))
    batch = [Generation(id=request_id, params=params)]
    return Work(Client(b"client"), GangCommand(kind=p.GENERATE, id=request_id, batch=batch), 0.0)


def _control(request_id: str) -> Work:
    control = p.ControlRequest(op="list_loras")
    return Work(Client(b"client"), GangCommand(kind=p.CONTROL, id=request_id, control=control), 0.0)


def _queue(max_images: int, wait_s: float, *works: Work) -> WorkQueue:
    queue = WorkQueue(16, Batching(max_images, wait_s))
    for work in works:
        queue.put_nowait(work)
    return queue


def _ids(works: list[Work]) -> list[str]:
    return [w.command.id for w in works]


def test_requests_differing_only_per_image_are_compatible() -> None:
    other = _params(
        prompt="a lighthouse",
        n=2,
        seed=[8, 9],
        output_format="jpeg",
        output_compression=80,
    )
    assert compatible(BASE, other)
    with_negatives = _params(negative_prompt="blurry", true_cfg_scale=4.0)
    assert compatible(with_negatives, _params(negative_prompt="dark", true_cfg_scale=4.0))
    per_image = {"prompt", "negative_prompt", "n", "seed", "output_format", "output_compression"}
    assert per_image == PER_IMAGE


@pytest.mark.parametrize(
    "change",
    [
        {"width": 128},
        {"height": 32},
        {"num_inference_steps": 5},
        {"guidance_scale": 2.0},
        {"true_cfg_scale": 4.0},
        {"negative_prompt": "blurry"},  # true CFG or not: the call differs
    ],
)
def test_requests_that_shape_the_call_differently_are_not(change: dict[str, object]) -> None:
    assert not compatible(BASE, _params(**change))


def test_the_rule_covers_every_field_but_the_per_image_ones() -> None:
    """A field added to GenerateParams joins the rule unless named per-image: every
    field's value takes part (here each one is set to an unusual value in turn)."""
    shaping = set(GenerateParams.__struct_fields__) - PER_IMAGE - {"edit", "partial_images"}
    for name in shaping:
        default = getattr(BASE, name)
        odd = object()  # equal to nothing: stands for any other value
        assert not compatible(BASE, msgspec.structs.replace(BASE, **{name: odd})), name
        assert compatible(BASE, msgspec.structs.replace(BASE, **{name: default})), name


def test_edits_and_previews_never_share_a_call() -> None:
    edit = _params(edit=EditInput(images=[0]))
    assert not compatible(edit, edit)
    previews = _params(partial_images=2)
    assert not compatible(previews, previews)


def test_a_lone_request_starts_at_once_without_the_window() -> None:
    queue = _queue(4, 5.0, _gen("a"), _gen("wide", width=128))
    started = time.monotonic()
    assert _ids(queue.start(timeout=0)) == ["a"]
    assert time.monotonic() - started < 1.0  # not the 5 s window: nothing could join
    assert queue.qsize() == 1


def test_compatible_work_joins_in_order_up_to_a_control_op() -> None:
    queue = _queue(
        4,
        5.0,
        _gen("a"),
        _gen("wide", width=128),  # passed over: keeps its place
        _gen("b", prompt="other"),
        _control("ctl"),  # changes the state: nothing past it may join
        _gen("c"),
    )
    started = time.monotonic()
    assert _ids(queue.start(timeout=0)) == ["a", "b"]
    assert time.monotonic() - started < 1.0  # stopped at the control op: no window
    assert _ids(queue.snapshot()) == ["a", "b", "wide", "ctl", "c"]
    queue.finish()
    assert _ids(queue.start(timeout=0)) == ["wide"]
    queue.finish()
    assert _ids(queue.start(timeout=0)) == ["ctl"]
    queue.finish()
    assert _ids(queue.start(timeout=0)) == ["c"]


def test_a_batch_holds_at_most_max_images_and_starts_once_full() -> None:
    queue = _queue(4, 5.0, _gen("a"), _gen("four", n=4), _gen("two", n=2), _gen("one"))
    started = time.monotonic()
    assert _ids(queue.start(timeout=0)) == ["a", "two", "one"]  # 1 + 2 + 1 images: full
    assert time.monotonic() - started < 1.0
    queue.finish()
    assert _ids(queue.start(timeout=0)) == ["four"]  # n >= max: alone, as without batching


def test_a_partly_filled_batch_waits_for_more_until_full() -> None:
    queue = _queue(3, 5.0, _gen("a"), _gen("b"))
    threading.Timer(0.2, lambda: queue.put_nowait(_gen("c"))).start()
    started = time.monotonic()
    assert _ids(queue.start(timeout=0)) == ["a", "b", "c"]
    assert 0.15 < time.monotonic() - started < 2.0  # until "c" came, not the whole window


def test_the_window_ends_a_partly_filled_batch() -> None:
    queue = _queue(4, 0.3, _gen("a"), _gen("b"))
    started = time.monotonic()
    assert _ids(queue.start(timeout=0)) == ["a", "b"]
    assert 0.25 < time.monotonic() - started < 2.0


def test_a_cancel_reaches_a_request_gathered_into_a_batch() -> None:
    queue = _queue(4, 0.3, _gen("a"), _gen("b"))
    # Cancelled while the window waits: the request is running, not queued.
    threading.Timer(0.1, lambda: queue.cancel("b", Client(b"client"))).start()
    assert _ids(queue.start(timeout=0)) == ["a", "b"]
    assert [(w.command.id, cancelled) for w, cancelled in queue.running()] == [
        ("a", False),
        ("b", True),
    ]
    b = queue.running()[1][0]
    queue.answered(b)  # it left its batch (Scheduler.halt answered it)
    assert _ids(queue.snapshot()) == ["a"]
    assert queue.cancel("b", Client(b"client"))[1] == p.CANCEL_NOT_FOUND  # answered already
    assert [(w.command.id, answered) for w, answered in queue.finish()] == [
        ("a", False),
        ("b", True),
    ]


def test_without_batching_every_request_runs_alone() -> None:
    queue = _queue(1, 5.0, _gen("a"), _gen("b"))
    assert _ids(queue.start(timeout=0)) == ["a"]


def test_split_hands_each_request_its_own_images() -> None:
    batch = [_params(n=1), _params(n=3), _params(n=2)]
    assert split(list("abcdef"), batch) == [["a"], ["b", "c", "d"], ["e", "f"]]
    with pytest.raises(ValueError):
        split(list("abc"), batch)


def test_a_batch_call_has_one_prompt_and_generator_per_image() -> None:
    pytest.importorskip("torch")
    from dpserve.worker.batch_call import batch_kwargs
    from dpserve.worker.pipeline import pipeline_kwargs

    accepted = {"negative_prompt": None, "true_cfg_scale": 1.0, "width": None, "height": None,
                "num_inference_steps": 28, "guidance_scale": 3.5}  # fmt: skip
    cfg = {"negative_prompt": "blurry", "true_cfg_scale": 4.0}
    one = _params(prompt="fox", n=2, seed=[5, 6], **cfg)
    other = _params(prompt="owl", seed=[9], **{**cfg, "negative_prompt": "dark"})
    kwargs = batch_kwargs([one, other], accepted, "pil")
    assert kwargs["prompt"] == ["fox", "fox", "owl"]
    assert kwargs["negative_prompt"] == ["blurry", "blurry", "dark"]
    assert kwargs["num_images_per_prompt"] == 1
    assert [g.initial_seed() for g in kwargs["generator"]] == [5, 6, 9]
    assert kwargs["width"] == 64 and kwargs["true_cfg_scale"] == 4.0
    # A batch of one is called exactly as before batching (the same bytes).
    alone = batch_kwargs([one], accepted, "pil")
    reference = pipeline_kwargs(one, accepted, "pil")
    assert alone.keys() == reference.keys()
    assert alone["prompt"] == "fox" and alone["num_images_per_prompt"] == 2
