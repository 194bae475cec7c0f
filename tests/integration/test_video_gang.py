"""A video on a --cfg 2 gang (rank 0 the conditional branch, rank 1 the unconditional
one, the text encoders on rank 0 alone) is the same mp4, byte for byte, as on one
rank; so are its progress and a halt; and an image-to-video model's, whose denoiser
takes more channels than it returns. A video without CFG splits its frames x tokens
over both ranks instead, and an sp gang splits every video's: the frames are one
rank's within rounding (tiny Wan-style models, ~90 s on 2 cores)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from dpserve.contract import protocol as p
from dpserve.contract import video as v

pytest.importorskip("torch")
pytest.importorskip("av")

from tests.video_gang import Answer, VideoRun, decoded_frames, run_videos

pytestmark = pytest.mark.gang


def _video(**fields: object) -> p.GenerateParams:
    base: dict[str, object] = dict(
        prompt="a red car", width=64, height=48, num_inference_steps=4, seed=[11]
    )
    spec = p.VideoSpec(num_frames=9, fps=16, seconds=0.5)
    return p.GenerateParams(**{**base, **fields}, video=spec)  # type: ignore[arg-type]


RUNS = (
    VideoRun(_video(negative_prompt="blurry")),  # guidance CFG at the default 5.0
    VideoRun(_video(guidance_scale=3.0)),  # CFG with the empty negative prompt
    VideoRun(_video(guidance_scale=1.0)),  # no CFG: both ranks run it whole
    VideoRun(_video(guidance_scale=1.0), halt_at=3),  # dropped at the third step
)


def _steps(answer: Answer) -> list[tuple[int, int]]:
    return [
        (m.body_as(v.VideoProgress).step, m.body_as(v.VideoProgress).steps) for m in answer.partials
    ]


def test_a_cfg_gang_makes_one_ranks_video_byte_for_byte(tiny_video_model: Path) -> None:
    gang = run_videos(tiny_video_model, RUNS, cfg=2)
    one = run_videos(tiny_video_model, RUNS, cfg=1)
    for index, (mine, theirs) in enumerate(zip(gang[:3], one[:3], strict=True)):
        assert mine.reply.kind == theirs.reply.kind == p.RESULT, index
        result = mine.reply.body_as(v.VideoResult)
        assert (result.num_frames, result.width, result.height, result.seed) == (9, 64, 48, 11)
        assert _steps(mine) == _steps(theirs) == [(s, 4) for s in range(1, 5)]
    for index in (0, 1):  # CFG: each rank ran its own branch's exact forward
        assert gang[index].reply.blobs == one[index].reply.blobs, index  # mp4 and thumbnail
    # Without CFG the two ranks split the video's tokens (lent to sequence parallel).
    _assert_near(gang[2], one[2])
    # With CFG each rank ran its own branch (4 steps, 4 passes), one rank both; without
    # it each rank ran half of every pass.
    assert [a.passes for a in gang[:3]] == [[4, 4], [4, 4], [4, 4]]
    assert [a.passes for a in one[:3]] == [[8], [8], [4]]
    assert [a.tokens for a in gang[:3]] == [[36, 36], [36, 36], [18, 18]]
    assert one[1].reply.blobs[0] != one[2].reply.blobs[0]  # and CFG changed the video
    halted, alone = gang[3], one[3]
    for answer in (halted, alone):
        assert answer.reply.kind == p.ERROR
        assert p.decode_error(answer.reply).code == p.CANCELLED
        assert _steps(answer) == [(1, 4), (2, 4)]


def test_a_cfg_gang_animates_an_image_as_one_rank_does(tiny_i2v_model: Path) -> None:
    buf = io.BytesIO()
    Image.new("RGB", (80, 60), (220, 30, 30)).save(buf, format="PNG")
    runs = [VideoRun(_video(edit=p.EditInput(images=[0])), blobs=(buf.getvalue(),))]
    (gang,), (one,) = run_videos(tiny_i2v_model, runs, cfg=2), run_videos(tiny_i2v_model, runs)
    assert gang.reply.kind == one.reply.kind == p.RESULT
    assert gang.reply.blobs == one.reply.blobs
    assert (gang.passes, one.passes) == ([4, 4], [8])


def _assert_near(mine: Answer, theirs: Answer) -> None:
    """The same video within rounding: a split's float sums differ in the last bits,
    which after decoding, 8-bit quantisation and H.264 leave the frames a grey level or
    so apart at most, where another seed's are tens apart."""
    assert mine.reply.kind == theirs.reply.kind == p.RESULT
    got, want = decoded_frames(mine.reply.blobs[0]), decoded_frames(theirs.reply.blobs[0])
    assert got.shape == want.shape
    gap = np.abs(got.astype(np.int16) - want.astype(np.int16))
    assert gap.mean() < 0.5 and gap.max() <= 8, (gap.mean(), gap.max())


def test_an_sp_gang_splits_every_video_and_makes_one_ranks_frames(tiny_video_model: Path) -> None:
    """Ulysses over 2 ranks: 36 tokens a pass (3 latent frames x 3 x 4 patches), 18 each."""
    runs = RUNS[:3]
    split = run_videos(tiny_video_model, runs, sp=2, ulysses=2)
    one = run_videos(tiny_video_model, runs)
    for mine, theirs in zip(split, one, strict=True):
        _assert_near(mine, theirs)
        assert len(mine.passes) == 2 and mine.passes[0] == mine.passes[1] == theirs.passes[0]
        assert (mine.tokens, theirs.tokens) == ([18, 18], [36])
    other_seed = run_videos(tiny_video_model, [VideoRun(_video(guidance_scale=1.0, seed=[12]))])
    apart = decoded_frames(other_seed[0].reply.blobs[0]).astype(np.int16)
    assert np.abs(apart - decoded_frames(one[2].reply.blobs[0])).mean() > 5  # the bound means it
