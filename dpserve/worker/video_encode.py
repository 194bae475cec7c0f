"""Encoding a generated video: H.264 in mp4 (PyAV, libx264) and a JPEG thumbnail.

The same frames make the same bytes, which takes three settings. The thread count is
fixed rather than left to the host's core count (x264 writes its settings into the
stream, and at 832x480 one thread and four made files of different sizes). Its
macroblock-tree rate control is off: with it, the same noisy 64x48 frames encoded
150 times in each of two busy processes gave 10 different files (its assembly: with
asm off, or mbtree off, always one), at the price of a few percent in size. And the
muxer stamps no creation time.
``+faststart`` puts the index (moov) before the media, so a player starts before the
download ends; it rewrites the file once at the end, so the container is written to
a temporary file, not to memory.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Final

import numpy as np
from PIL import Image

from dpserve.worker.encode import encode_image

# x264's constant-quality factor: 18 is about visually lossless (its default is 23).
CRF: Final = 18
ENCODER_THREADS: Final = 4


def to_uint8(frames: np.ndarray) -> np.ndarray:
    """Pipeline frames (float in [0, 1], frames x height x width x 3) as 8-bit RGB."""
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"frames must be F x H x W x 3, got shape {frames.shape}")
    if frames.dtype == np.uint8:
        return frames
    return np.clip(np.rint(frames.astype(np.float32) * 255.0), 0, 255).astype(np.uint8)


def encode_mp4(frames: np.ndarray, fps: int) -> bytes:
    """``frames`` (8-bit RGB, F x H x W x 3, even sides) as an H.264 yuv420p mp4 at ``fps``."""
    import av  # loaded by video models only: an image worker needs no PyAV (35 MB)

    count, height, width, _ = frames.shape
    if count == 0 or width % 2 or height % 2:
        raise ValueError(f"an mp4 needs frames with even sides, got {count}x{width}x{height}")
    with tempfile.TemporaryDirectory(prefix="dpserve-video-") as folder:
        path = Path(folder) / "video.mp4"
        with av.open(str(path), mode="w", format="mp4", options={"movflags": "+faststart"}) as out:
            stream = out.add_stream("libx264", rate=fps)
            stream.width, stream.height = width, height
            stream.pix_fmt = "yuv420p"
            stream.options = {"crf": str(CRF), "threads": str(ENCODER_THREADS), "mbtree": "0"}
            for frame in frames:
                picture = av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")
                out.mux(stream.encode(picture))
            out.mux(stream.encode(None))  # flush the frames x264 holds back
        return path.read_bytes()


def encode_thumbnail(frames: np.ndarray) -> bytes:
    """The first frame as a JPEG."""
    return encode_image(Image.fromarray(frames[0]), "jpeg")
