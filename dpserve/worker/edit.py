"""Edits: uploaded images (and a mask) through the model's image-to-image, inpainting
or edit pipeline, built over the loaded modules.

Two halves. The driver's socket thread checks every upload from its header alone (bytes,
format, pixels, the mask's size) and what the model can take, so a bad edit is
refused before it queues. The gang then decodes the files and builds the pipeline
to call: the loaded one when it is an edit model (its ``__call__`` takes ``image``,
as Flux Kontext or Qwen-Image-Edit do), else diffusers' image-to-image or
inpainting sibling from ``from_pipe``, which shares the loaded modules (no second
copy of the weights). The sibling is made per request, never kept: a weight
update replaces modules, and a kept sibling would go on rendering with (and
holding) the old ones.
"""

from __future__ import annotations

import inspect
import io
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from PIL import Image, UnidentifiedImageError

from dpserve.contract.protocol import (
    INVALID_REQUEST,
    UNSUPPORTED,
    EditInput,
    FieldError,
    GenerateParams,
    RequestError,
)
from dpserve.contract.validation import (
    MAX_EDIT_IMAGE_BYTES,
    MAX_EDIT_IMAGES,
    MAX_EDIT_PIXELS,
    UPLOAD_FORMAT_NAMES,
    UPLOAD_FORMATS,
)

if TYPE_CHECKING:  # the driver's socket thread checks uploads without loading torch
    from dpserve.worker.pipeline import Pipeline

# Edit models whose ``image`` argument takes several reference images (a list);
# other edit models read a list as a batch, so they get one image.
_MULTI_REFERENCE: Final = frozenset({"QwenImageEditPlusPipeline", "Flux2Pipeline"})
# Edit models that cannot make an image from the prompt alone (their call reads the
# reference image's size before anything else); Flux Kontext and FLUX.2 can.
_IMAGE_REQUIRED: Final = frozenset({"QwenImageEditPipeline", "QwenImageEditPlusPipeline"})
_UNREADABLE: Final = (UnidentifiedImageError, Image.DecompressionBombError, OSError, ValueError)


@dataclass(frozen=True)
class EditSupport:
    """What edits a loaded pipeline can serve."""

    edits: bool
    inpainting: bool
    max_images: int  # 0 without edits
    needs_image: bool = False  # every request must be an edit (Qwen-Image-Edit)


def _takes(pipe: Pipeline, arg: str) -> bool:
    return arg in inspect.signature(pipe.__call__).parameters


def _sibling(auto: Any, pipe: Pipeline, why: str) -> Pipeline:
    try:
        sibling = auto.from_pipe(pipe)
    except ValueError as exc:  # diffusers knows no such pipeline for this model
        raise RequestError(UNSUPPORTED, f"{why}; {type(pipe).__name__} has none: {exc}") from None
    sibling.set_progress_bar_config(disable=True)
    return sibling


def image_to_image(pipe: Pipeline) -> Pipeline:
    """The pipeline that starts from an image: the loaded one if it is an edit model."""
    if _takes(pipe, "image") and not _takes(pipe, "mask_image"):
        return pipe
    from diffusers import AutoPipelineForImage2Image

    return _sibling(AutoPipelineForImage2Image, pipe, "an edit needs an image-to-image pipeline")


def inpainting(pipe: Pipeline) -> Pipeline:
    if _takes(pipe, "mask_image"):
        return pipe
    from diffusers import AutoPipelineForInpainting

    return _sibling(AutoPipelineForInpainting, pipe, "a mask needs an inpainting pipeline")


def edit_support(pipe: Pipeline) -> EditSupport:
    """Found by building the siblings once (cheap: they share the modules)."""
    try:
        edit_pipe = image_to_image(pipe)
    except RequestError:
        return EditSupport(edits=False, inpainting=False, max_images=0)
    name = type(pipe).__name__ if edit_pipe is pipe else ""
    try:
        inpainting(pipe)
        # Qwen-Image-Edit's inpainting sibling renders at about 1024x1024 pixels whatever
        # size is asked (diffusers 0.42): its replies and previews would not be the size
        # the request was given, so masks are refused for those models.
        can_inpaint = name not in _IMAGE_REQUIRED
    except RequestError:
        can_inpaint = False
    return EditSupport(
        edits=True,
        inpainting=can_inpaint,
        max_images=MAX_EDIT_IMAGES if name in _MULTI_REFERENCE else 1,
        needs_image=name in _IMAGE_REQUIRED,
    )


def check_generation(support: EditSupport | None) -> None:
    """Refuse a request without images for a model that only edits."""
    if support is not None and support.needs_image:
        raise RequestError(
            UNSUPPORTED,
            "this model only edits images: send the prompt with an image (POST /v1/images/edits)",
            [FieldError("image", "is required by this model")],
        )


# ---------------------------------------------------------------- uploads


def _bad(field: str, message: str) -> RequestError:
    return RequestError(
        INVALID_REQUEST, f"invalid request: {field} {message}", [FieldError(field, message)]
    )


def _pixels_problem(width: int, height: int) -> str | None:
    if width * height <= MAX_EDIT_PIXELS:
        return None
    return (
        f"is {width}x{height} ({width * height} pixels); at most 4096x4096 pixels "
        f"({MAX_EDIT_PIXELS}): upload a smaller image"
    )


def upload_size(data: bytes, field: str) -> tuple[int, int]:
    """An upload's size, read from its header only (nothing is decoded)."""
    if len(data) > MAX_EDIT_IMAGE_BYTES:
        limit = MAX_EDIT_IMAGE_BYTES >> 20
        raise _bad(field, f"is {len(data)} bytes; at most {limit} MiB: upload a smaller file")
    try:
        with Image.open(io.BytesIO(data), formats=UPLOAD_FORMATS) as img:
            size = img.size
            img.verify()  # structure and checksums, without decoding the pixels
    except Image.DecompressionBombError:
        raise _bad(field, f"has too many pixels; at most {MAX_EDIT_PIXELS} (4096x4096)") from None
    except _UNREADABLE as exc:
        raise _bad(field, f"is not a readable image ({UPLOAD_FORMAT_NAMES}): {_why(exc)}") from None
    problem = _pixels_problem(*size)
    if problem is not None:
        raise _bad(field, problem)
    return size


def check_edit(
    edit: EditInput, blobs: Sequence[bytes], support: EditSupport | None
) -> tuple[int, int]:
    """Refuse an edit the model cannot serve or whose uploads are bad; the first
    image's size. ``support`` None: the model is unknown here (checks the files only)."""
    if support is not None:
        if not support.edits:
            raise RequestError(
                UNSUPPORTED,
                "this model serves no edits (no image-to-image, inpainting or edit pipeline)",
                [FieldError("image", "is not supported by this model")],
            )
        if edit.mask is not None and not support.inpainting:
            raise RequestError(
                UNSUPPORTED,
                "this model serves no inpainting: send the edit without a mask",
                [FieldError("mask", "is not supported by this model")],
            )
        if len(edit.images) > support.max_images:
            raise RequestError(
                UNSUPPORTED,
                f"this model's edit pipeline takes at most {support.max_images} image(s), "
                f"got {len(edit.images)}",
                [FieldError("image", f"must be at most {support.max_images} image(s)")],
            )
    sizes = [upload_size(blobs[b], f"image[{i}]") for i, b in enumerate(edit.images)]
    if edit.mask is not None:
        mask = upload_size(blobs[edit.mask], "mask")
        if mask != sizes[0]:
            raise _bad(
                "mask",
                f"is {mask[0]}x{mask[1]} but image[0] is {sizes[0][0]}x{sizes[0][1]}: "
                "the mask must be the size of the first image",
            )
    return sizes[0]


def fitted_size(size: tuple[int, int], factor: int, max_side: int | None = None) -> tuple[int, int]:
    """The output size an image gives: its own, scaled down to fit ``max_side`` and
    rounded down to the model's multiple (at least one multiple)."""
    width, height = size
    if max_side is not None and max(width, height) > max_side:
        scale = max_side / max(width, height)
        width, height = int(width * scale), int(height * scale)
    return max(factor, width // factor * factor), max(factor, height // factor * factor)


def decode_image(data: bytes, field: str) -> Image.Image:
    """An upload decoded to RGB; its pixels are bounded from the header first."""
    return _decoded(data, field).convert("RGB")


def decode_mask(data: bytes) -> Image.Image:
    """A mask as the pipelines read it: white repaints. A mask with transparency is
    read as OpenAI's are: transparent pixels are the ones to repaint."""
    img = _decoded(data, "mask")
    if "A" in img.getbands() or "transparency" in img.info:
        alpha = img.convert("RGBA").getchannel("A")
        return alpha.point(lambda a: 255 - a)
    return img.convert("L")


def _decoded(data: bytes, field: str) -> Image.Image:
    try:
        with Image.open(io.BytesIO(data), formats=UPLOAD_FORMATS) as img:
            problem = _pixels_problem(img.width, img.height)
            if problem is not None:
                raise _bad(field, problem)
            img.load()
            return img.copy()
    except _UNREADABLE as exc:
        raise _bad(field, f"is not a readable image ({UPLOAD_FORMAT_NAMES}): {_why(exc)}") from None


def _why(exc: Exception) -> str:
    """What Pillow found, in the client's terms: its "cannot identify" names the
    in-memory file object (a Python repr), which says nothing to a client."""
    if isinstance(exc, UnidentifiedImageError):
        return f"its bytes are not a {UPLOAD_FORMAT_NAMES} image (other formats are refused)"
    return re.sub(r"<[^<>]* at 0x[0-9a-fA-F]+>", "the upload", str(exc))


# ---------------------------------------------------------------- the call


def edit_call(
    pipe: Pipeline, params: GenerateParams, blobs: Sequence[bytes], factor: int
) -> tuple[Pipeline, dict[str, Any]]:
    """The pipeline that serves ``params.edit`` and its extra arguments (images, mask,
    strength, and the first image's size when the request gave none)."""
    edit = params.edit
    assert edit is not None
    images = [decode_image(blobs[b], f"image[{i}]") for i, b in enumerate(edit.images)]
    target = inpainting(pipe) if edit.mask is not None else image_to_image(pipe)
    many = target is pipe and type(pipe).__name__ in _MULTI_REFERENCE
    if len(images) > 1 and not many:
        raise RequestError(
            UNSUPPORTED,
            f"{type(target).__name__} takes one image, got {len(images)}",
            [FieldError("image", "must be one image for this model")],
        )
    width, height = fitted_size(images[0].size, factor)
    extra: dict[str, Any] = {
        "image": images if many else images[0],
        "width": params.width or width,
        "height": params.height or height,
    }
    if edit.mask is not None:
        extra["mask_image"] = decode_mask(blobs[edit.mask])
    if edit.strength is not None:
        if not _takes(target, "strength"):
            raise RequestError(
                UNSUPPORTED,
                f"{type(target).__name__} does not take strength",
                [FieldError("strength", "is not supported by this model's edit pipeline")],
            )
        extra["strength"] = edit.strength
    _check_steps(target, params, extra.get("strength"))
    return target, extra


def _check_steps(target: Pipeline, params: GenerateParams, strength: float | None) -> None:
    """Image-to-image runs int(steps * strength) steps: at least one, or diffusers fails."""
    accepted = inspect.signature(target.__call__).parameters
    if "strength" not in accepted:
        return
    if strength is None:
        strength = accepted["strength"].default
    steps = params.num_inference_steps or accepted["num_inference_steps"].default
    if isinstance(strength, float) and isinstance(steps, int) and int(steps * strength) < 1:
        raise _bad(
            "strength",
            f"{strength:g} x num_inference_steps {steps} leaves no denoising step: raise either",
        )
