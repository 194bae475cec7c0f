"""Deadlines and cancels reach the work: real replicas (one rank, and a CFG-parallel gang of
two) drop a long generation at its next denoising step, stay in step, and serve the next
request at once instead of after the full render."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from dpserve.contract import protocol as p
from tests.workers import WorkerProcess, until_denoising

pytestmark = pytest.mark.gang

LONG = dict(prompt="a long one", width=256, height=256, num_inference_steps=150, seed=5)
QUICK = dict(prompt="a quick one", width=64, height=64, num_inference_steps=2, seed=6)
TRUE_CFG = dict(negative_prompt="blurry", true_cfg_scale=4.0)
DEADLINE_S = 0.6  # at most: a sixth of the full render on a machine fast enough to need less


@dataclass
class Gang:
    worker: WorkerProcess
    cfg: int
    quick: dict[str, Any]
    quick_png: bytes = b""
    _full: dict[str, float] = field(default_factory=dict)

    @property
    def long_requests(self) -> dict[str, dict[str, Any]]:
        """One rank: plain. A CFG gang: plain (its ranks share the tokens) and true CFG
        (each rank runs one branch): two paths through the gang's collectives."""
        found = {"plain": LONG}
        if self.cfg == 2:
            found["true-cfg"] = {**LONG, **TRUE_CFG}
        return found

    def full_render_s(self, request: dict[str, Any]) -> float:
        """Wall time of the request rendered to the end (measured once)."""
        key = repr(sorted(request.items()))
        if key not in self._full:
            with self.worker.client() as client:
                start = time.monotonic()
                client.generate(**request)
                self._full[key] = time.monotonic() - start
        return self._full[key]


@pytest.fixture(scope="module", params=[1, 2], ids=["cfg1", "cfg2"])
def gang(request: pytest.FixtureRequest, tiny_model: Path) -> Iterator[Gang]:
    cfg: int = request.param
    args = ["--max-steps", "1000", *(["--cfg", "2"] if cfg == 2 else [])]
    # The quick request takes the CFG split on a CFG gang: its bytes after a drop show
    # that both ranks are still in step (a rank a collective behind would hang or differ).
    quick = {**QUICK, **TRUE_CFG} if cfg == 2 else QUICK
    with WorkerProcess(tiny_model, *args) as worker:
        found = Gang(worker, cfg, quick)
        with worker.client() as client:
            found.quick_png = client.generate(**quick)[1][0]
        yield found


def _error(message: p.Message) -> p.RequestError:
    assert message.kind == p.ERROR, "the long request was rendered to the end"
    return p.decode_error(message)


def _serve_quick(gang: Gang) -> None:
    with gang.worker.client(timeout_s=60) as client:
        _, (png,) = client.generate(**gang.quick)
        assert png == gang.quick_png
        ping = client.ping()
    assert ping.status == "ok" and not ping.busy and ping.queue_depth == 0


def _report(what: str, gang: Gang, answered: str, freed: float, full: float) -> None:
    print(
        f"\n[{what}, cfg{gang.cfg}] answered {answered}, next request done "
        f"{freed:.2f}s after the first was sent; full render {full:.2f}s: "
        f"time-to-free / full render = {freed / full:.2f}"
    )


def test_a_long_generation_past_its_deadline_is_dropped_midway(gang: Gang) -> None:
    for name, request in gang.long_requests.items():
        _past_deadline(gang, name, request)


def _past_deadline(gang: Gang, name: str, request: dict[str, Any]) -> None:
    full = gang.full_render_s(request)
    deadline_s = min(DEADLINE_S, full / 6)
    with gang.worker.client(timeout_s=60) as client:
        start = time.monotonic()
        client.send_raw(p.encode(p.GENERATE, "late", request, timeout_ms=int(deadline_s * 1000)))
        reply = client.recv()
        answered = time.monotonic() - start
    error = _error(reply)
    assert reply.id == "late" and error.code == p.DEADLINE_EXCEEDED and error.status == 504
    assert "while it ran" in str(error) and "dropped at denoiser call" in str(error)
    _serve_quick(gang)
    freed = time.monotonic() - start
    _report(f"deadline, {name}", gang, f"{answered:.2f}s after it was sent", freed, full)
    assert deadline_s <= answered < deadline_s + 1.5
    assert freed < 0.5 * full


def test_a_cancelled_generation_frees_the_replica(gang: Gang) -> None:
    for name, request in gang.long_requests.items():
        _cancelled(gang, name, request)


def _cancelled(gang: Gang, name: str, request: dict[str, Any]) -> None:
    full = gang.full_render_s(request)
    with gang.worker.client(timeout_s=60) as client, gang.worker.client() as pinger:
        start = time.monotonic()
        client.send_raw(p.encode(p.GENERATE, "doomed", request))
        until_denoising(pinger)
        cancel = p.CancelRequest(request_id="doomed")
        cancelled_at = time.monotonic()
        client.send_raw(p.encode(p.CANCEL, "cancel-1", cancel))
        reply = client.recv()
        answered = time.monotonic() - cancelled_at
    error = _error(reply)
    assert reply.id == "doomed" and error.code == p.CANCELLED and error.status == 499
    assert "dropped at denoiser call" in str(error)
    _serve_quick(gang)
    freed = time.monotonic() - start
    _report(f"cancel, {name}", gang, f"{answered:.2f}s after the cancel", freed, full)
    assert answered < 1.5  # one denoising step (tens of ms here) and the trip, load aside
    assert freed < 0.5 * full
