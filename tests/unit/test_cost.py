"""The cost model and the replica's calibration of it, as pure code."""

from __future__ import annotations

import math
import threading

import msgspec
import pytest

from dpserve.contract.cost import Calibration, cost_units
from dpserve.contract.protocol import (
    CostReport,
    EditInput,
    GenerateParams,
)
from dpserve.worker.load import BusyWindow

SHAPE = CostReport(default_width=1024, default_height=512, default_steps=20, text_megapixels=0.02)


def _params(**kw: object) -> GenerateParams:
    return GenerateParams(prompt="x", **kw)  # type: ignore[arg-type]


def test_units_are_steps_times_image_and_text_megapixels_times_branches_and_n() -> None:
    assert cost_units(_params(width=1000, height=1000, num_inference_steps=10), SHAPE) == (
        pytest.approx(10 * 1.02)
    )
    # The replica's defaults fill what the request leaves out.
    assert cost_units(_params(), SHAPE) == pytest.approx(20 * (1024 * 512 / 1e6 + 0.02))
    base = cost_units(_params(width=256, height=256, num_inference_steps=4), SHAPE)
    assert cost_units(_params(width=256, height=256, num_inference_steps=4, n=3), SHAPE) == (
        pytest.approx(3 * base)
    )
    # A small request is not 16x cheaper per step than one at 4x the side: the text is fixed.
    small = cost_units(_params(width=64, height=64, num_inference_steps=4), SHAPE)
    assert 0.2 < small / base < 0.5


def test_true_cfg_doubles_only_with_a_negative_prompt_and_a_scale_above_one() -> None:
    one = cost_units(_params(width=256, height=256), SHAPE)
    cfg = _params(width=256, height=256, negative_prompt="blur", true_cfg_scale=4.0)
    assert cost_units(cfg, SHAPE) == pytest.approx(2 * one)
    assert cost_units(_params(width=256, height=256, negative_prompt="blur"), SHAPE) == one
    # A pipeline whose default scale is above 1 runs two branches for a bare negative prompt.
    qwen_like = msgspec.structs.replace(SHAPE, default_true_cfg_scale=4.0)
    bare = _params(width=256, height=256, negative_prompt="blur")
    assert cost_units(bare, qwen_like) == pytest.approx(2 * one)
    assert cost_units(_params(width=256, height=256, true_cfg_scale=4.0), SHAPE) == one


def test_an_edits_strength_scales_its_steps_as_diffusers_does() -> None:
    edit = EditInput(images=[0], strength=0.55)
    full = cost_units(_params(width=256, height=256, num_inference_steps=20), SHAPE)
    part = _params(width=256, height=256, num_inference_steps=20, edit=edit)
    assert cost_units(part, SHAPE) == pytest.approx(full * 11 / 20)  # int(20 * 0.55)
    tiny = _params(
        width=256, height=256, num_inference_steps=2, edit=EditInput(images=[0], strength=0.1)
    )
    assert cost_units(tiny, SHAPE) == pytest.approx(full / 20)  # at least one step
    unknown = _params(width=256, height=256, num_inference_steps=20, edit=EditInput(images=[0]))
    assert cost_units(unknown, SHAPE) == pytest.approx(full)  # the pipeline's own default


def test_calibration_starts_unknown_and_reports_its_shape() -> None:
    cal = Calibration(SHAPE)
    report = cal.report()
    assert report.seconds_per_unit is None and report.samples == 0
    assert (report.default_width, report.default_height, report.text_megapixels) == (
        1024,
        512,
        0.02,
    )
    cal.observe(0.0, 1.0)  # nothing to learn from: ignored
    cal.observe(1.0, float("nan"))
    assert cal.report().samples == 0
    cal.observe(2.0, 1.0)
    assert cal.seconds_per_unit == pytest.approx(0.5)
    assert cal.report().samples == 1


def test_a_slow_first_sample_counts_only_until_a_normal_one_comes() -> None:
    cal = Calibration()
    cal.observe(1.0, 30.0)  # a first request that paid for new shapes
    assert cal.seconds_per_unit == pytest.approx(30.0)
    cal.observe(1.0, 2.0)
    assert cal.seconds_per_unit == pytest.approx(2.0)  # the lower of two
    cal.observe(1.0, 2.2)
    assert cal.seconds_per_unit == pytest.approx(2.2)  # the middle of three
    for _ in range(20):
        cal.observe(1.0, 2.0)
    assert cal.seconds_per_unit == pytest.approx(2.0, rel=0.01)


def test_forget_drops_every_sample_and_keeps_the_shape() -> None:
    cal = Calibration(SHAPE)
    for seconds in (70.0, 60.0, 65.0):  # warm-ups (compiling)
        cal.observe(1.0, seconds)
    cal.forget()
    assert cal.seconds_per_unit is None and cal.report().samples == 0
    assert cal.report().default_height == 512
    cal.observe(1.0, 0.5)
    assert cal.seconds_per_unit == pytest.approx(0.5)


def test_one_stall_moves_the_estimate_a_bounded_step_and_a_lasting_change_is_followed() -> None:
    cal = Calibration(alpha=0.2, max_ratio=4.0)
    for _ in range(5):
        cal.observe(2.0, 2.0)
    cal.observe(1.0, 100.0)  # a 100x stall
    assert cal.seconds_per_unit == pytest.approx(4.0**0.2)
    for _ in range(5):
        cal.observe(1.0, 1.0)
    assert cal.seconds_per_unit == pytest.approx(1.0, rel=0.3)
    for _ in range(30):
        cal.observe(1.0, 3.0)  # the replica got three times slower, for good
    assert cal.seconds_per_unit == pytest.approx(3.0, rel=0.05)


def test_configure_keeps_the_calibration_and_observe_is_thread_safe() -> None:
    cal = Calibration()

    def observe() -> None:
        for _ in range(500):
            cal.observe(1.0, 0.5)

    threads = [threading.Thread(target=observe) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert cal.report().samples == 2000
    cal.configure(SHAPE)
    assert cal.seconds_per_unit == pytest.approx(0.5) and cal.report().default_height == 512
    assert math.isclose(cal.units(_params()), cost_units(_params(), SHAPE))


def test_busy_window_is_the_share_of_the_last_window_spent_busy() -> None:
    window = BusyWindow(window_s=10.0)
    assert window.fraction(100.0) == 0.0 and not window.busy
    window.set(True, 100.0)
    assert window.busy and window.fraction(104.0) == pytest.approx(0.4)  # open interval counts
    window.set(False, 105.0)
    window.set(True, 107.0)
    window.set(False, 108.0)
    assert window.fraction(110.0) == pytest.approx(0.6)
    assert window.fraction(112.0) == pytest.approx(0.4)  # the first interval slides out
    window.set(True, 113.0)
    assert window.fraction(125.0) == pytest.approx(1.0)  # clipped at the window's start
    window.set(False, 125.0)
    assert window.fraction(140.0) == 0.0
