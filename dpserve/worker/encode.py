"""Encoding rendered images to the wire's formats."""

from __future__ import annotations

import io
from typing import Final

from PIL import Image

# Without output_compression: JPEG at a high fixed quality, WebP lossless, so an
# image that does not ask for compression loses as little as its format allows.
DEFAULT_JPEG_QUALITY: Final = 95


def encode_image(image: Image.Image, fmt: str, compression: int | None = None) -> bytes:
    """``image`` as a ``fmt`` file; ``compression`` (0-100, OpenAI's output_compression)
    is the JPEG or lossy-WebP quality: 100 keeps the most, lower values make smaller
    files. PNG is always lossless (the protocol refuses compression for it)."""
    buf = io.BytesIO()
    if fmt == "png":
        image.save(buf, format="PNG")
    elif fmt == "jpeg":
        quality = DEFAULT_JPEG_QUALITY if compression is None else compression
        image.convert("RGB").save(buf, format="JPEG", quality=quality)
    elif compression is None:
        image.save(buf, format="WEBP", lossless=True)
    else:
        image.save(buf, format="WEBP", quality=compression)
    return buf.getvalue()
