"""Wan under tensor parallel, and Wan 2.2's two denoisers in a gang: final latents of
real gangs (float32, same seed, guidance CFG, one thread per rank) within 1e-5 of one
rank's, as the image layouts (test_parallel_math.py) and the video sequence split
(test_video_parallel_math.py) are held."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.integration.test_video_parallel_math import REQUEST
from tests.parallel_harness import final_latents, gang_run, relative_error

pytestmark = pytest.mark.gang

# The tiny video model has 2 heads: tp2 leaves one a rank, so tp combines with cfg.
VIDEO_LAYOUTS = {
    "tp2": dict(tp=2),
    "cfg2xtp2": dict(cfg=2, tp=2),
}


@pytest.fixture(scope="module")
def video_reference(tiny_video_model: Path) -> torch.Tensor:
    return final_latents(tiny_video_model, {}, REQUEST)


@pytest.mark.parametrize("name", list(VIDEO_LAYOUTS))
def test_wan_tp_matches_one_rank(
    name: str, tiny_video_model: Path, video_reference: torch.Tensor
) -> None:
    latents, reads = gang_run(tiny_video_model, VIDEO_LAYOUTS[name], REQUEST)
    error = relative_error(latents, video_reference)
    assert error <= 1e-5, f"{name}: relative error {error:.2e}"
    # Each rank read only its pieces: half of every cut tensor (q/k norms included).
    assert all(r["split"] == pytest.approx(0.5) for r in reads), reads
