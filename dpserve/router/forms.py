"""Multipart forms (edits, a video's reference image): read as they arrive, their text
fields turned into the typed body the generation parser checks.

A form is never held whole in memory: starlette's parser writes each file part to a
spooled temporary file (memory up to 1 MiB, disk past it) while the body arrives
within the upload limit and the body timeout, so a slow 64 MiB upload holds no more
than a megabyte of the router's memory. A file is read back only once its size and
its first bytes (PNG, JPEG or WebP) pass; the files are closed when the form is.

The router never decodes an image (it has no Pillow): it checks counts, byte sizes
and signatures, and the replica's driver checks the pixels and the mask's size
before the request queues, answering 400s that name the upload.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Final

from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import Request

from dpserve.contract import protocol as p
from dpserve.contract import validation as pv
from dpserve.router.bodies import BadBody, check_declared, limited, too_slow
from dpserve.router.schemas import FormTypes, ImageEditForm, form_types

FORM_TYPE: Final = "multipart/form-data"
IMAGE_FIELDS: Final = ("image", "image[]")  # the openai client sends a list as image[]
MASK_FIELD: Final = "mask"
# Form fields are text: these become numbers or switches before the body is checked.
EDIT_TYPES: Final = form_types(ImageEditForm)
_MAX_FIELDS: Final = 64
_MAX_FIELD_BYTES: Final = 64 << 10  # a prompt is at most 40 KB of UTF-8


@dataclass
class EditForm:
    fields: dict[str, str] = field(default_factory=dict)
    images: list[bytes] = field(default_factory=list)
    mask: bytes | None = None

    def blobs(self) -> list[bytes]:
        """What goes to the replica after the header: the images, then the mask."""
        return [*self.images, *([self.mask] if self.mask is not None else [])]

    def body(self) -> dict[str, Any]:
        """The fields as the generation parser takes them, with ``edit`` naming the blobs;
        a value that is not what its field needs is a 400 naming the field."""
        problems: list[p.FieldError] = []
        body: dict[str, Any] = {}
        for name, text in self.fields.items():
            if name == "strength":
                continue
            body[name] = _typed(name, text, problems)
        strength = (
            _typed("strength", self.fields["strength"], problems)
            if ("strength" in self.fields)
            else None
        )
        if problems:
            raise pv.invalid_fields(problems)
        k = len(self.images)
        body["edit"] = {
            "images": list(range(k)),
            "mask": k if self.mask is not None else None,
            "strength": strength,
        }
        return body

    def variation_body(self) -> dict[str, Any]:
        """OpenAI's variation: an image-to-image edit of one image, without a prompt (the
        pipeline's unconditioned text); a prompt or a mask makes it an edit, so it says so."""
        problems: list[p.FieldError] = []
        if "prompt" in self.fields:
            problems.append(p.FieldError("prompt", _NO_PROMPT))
        if self.mask is not None:
            problems.append(p.FieldError(MASK_FIELD, _NO_MASK))
        if len(self.images) > 1:
            problems.append(p.FieldError("image", "a variation starts from one image"))
        if problems:
            raise pv.invalid_fields(problems)
        return {**self.body(), "prompt": ""}


_NO_PROMPT: Final = "a variation takes none: for an edit with a prompt use POST /v1/images/edits"
_NO_MASK: Final = "a variation takes none: inpainting is POST /v1/images/edits"


def is_form(content_type: str | None) -> bool:
    return content_type is not None and content_type.split(";", 1)[0].strip().lower() == FORM_TYPE


FormItems = list[tuple[str, UploadFile | str]]


@asynccontextmanager
async def spooled_form(
    request: Request, limit: int, timeout_s: float, max_files: int
) -> AsyncIterator[FormItems]:
    """A multipart body's parts, in order, its files spooled (see the module's note):
    at most ``limit`` bytes (413) within ``timeout_s`` (408); a malformed one is a 400.
    The files are closed when the block ends."""
    check_declared(request, limit)
    parser = MultiPartParser(
        request.headers,
        limited(request, limit),
        max_files=max_files,
        max_fields=_MAX_FIELDS,
        max_part_size=_MAX_FIELD_BYTES,
    )
    try:  # the parser closes its files itself when it fails
        form = await asyncio.wait_for(parser.parse(), timeout_s)
    except TimeoutError:
        raise too_slow(timeout_s) from None
    except MultiPartException as exc:
        raise BadBody(400, f"malformed {FORM_TYPE} body: {exc}") from None
    try:
        yield form.multi_items()
    finally:
        await form.close()


async def read_edit(request: Request, limit: int, timeout_s: float) -> EditForm:
    """An edit's (or variation's) form; 415 for any other body, before it is read."""
    content_type = request.headers.get("content-type")
    if not is_form(content_type):
        got = f"got {content_type!r}" if content_type else "got none"
        raise BadBody(415, f"send an edit as {FORM_TYPE} (OpenAI's edit form; {got})")
    async with spooled_form(request, limit, timeout_s, pv.MAX_EDIT_IMAGES + 1) as items:
        return await parse_form(items)


async def parse_form(items: FormItems) -> EditForm:
    form = EditForm()
    problems: list[p.FieldError] = []
    for name, value in items:
        if isinstance(value, UploadFile):
            await _file(form, name, value, problems)
        elif name in IMAGE_FIELDS or name == MASK_FIELD:
            problems.append(p.FieldError(name, "must be a file upload, not text"))
        elif name in form.fields:
            problems.append(p.FieldError(name, "is given more than once"))
        else:
            form.fields[name] = value
    if not form.images and not any(f.field in IMAGE_FIELDS for f in problems):
        problems.append(p.FieldError("image", "is required: upload one or more image files"))
    if problems:
        raise pv.invalid_fields(problems)
    return form


async def _file(form: EditForm, name: str, upload: UploadFile, out: list[p.FieldError]) -> None:
    if name not in (*IMAGE_FIELDS, MASK_FIELD):
        out.append(p.FieldError(name, "is not a known field (files go in image, image[], mask)"))
        return
    if name == MASK_FIELD and form.mask is not None:
        out.append(p.FieldError(name, "give one mask"))
        return
    if name != MASK_FIELD and len(form.images) >= pv.MAX_EDIT_IMAGES:
        out.append(p.FieldError(name, f"at most {pv.MAX_EDIT_IMAGES} images per edit"))
        return
    data = await read_image(upload, name, out)
    if data is None:
        return
    if name == MASK_FIELD:
        form.mask = data
    else:
        form.images.append(data)


async def read_image(upload: UploadFile, name: str, out: list[p.FieldError]) -> bytes | None:
    """An uploaded image file's bytes, read from its spool only when its size and its
    signature pass; else None, with the problem recorded in ``out`` under ``name``."""
    filename = upload.filename or name
    size = upload.size or 0
    await upload.seek(0)
    problem = image_problem(await upload.read(12), size, filename)
    if problem is not None:
        out.append(p.FieldError(name, problem))
        return None
    await upload.seek(0)
    return await upload.read()


def image_problem(head: bytes, size: int, filename: str) -> str | None:
    """What is wrong with an image upload of ``size`` bytes starting with ``head``."""
    if not size:
        return f"{filename!r} is empty"
    if size > pv.MAX_EDIT_IMAGE_BYTES:
        limit = pv.MAX_EDIT_IMAGE_BYTES >> 20
        return f"{filename!r} is {size} bytes; at most {limit} MiB"
    if pv.upload_format(head) is None:
        return f"{filename!r} is not a {pv.UPLOAD_FORMAT_NAMES} image; send one of those formats"
    return None


def _typed(name: str, text: str, out: list[p.FieldError]) -> Any:
    """A form string as its field's type; unknown fields stay text (the parser names them)."""
    return typed_value(name, text, out, EDIT_TYPES)


def typed_value(name: str, text: str, out: list[p.FieldError], types: FormTypes) -> Any:
    """A form string as the type its field has in ``types`` (others stay text; one that
    may be structured is JSON when it starts as an object or a list, else text: a
    ``lora`` form field holds JSON or a bare name); a bad one is recorded in ``out``
    and comes back None."""
    try:
        if name in types.ints:
            return int(text)
        if name in types.floats:
            return float(text)
    except ValueError:
        kind = "a number" if name in types.floats else "an integer"
        out.append(p.FieldError(name, f"must be {kind}, got {text[:40]!r}"))
        return None
    if name in types.bools:
        if text.lower() in ("true", "false"):
            return text.lower() == "true"
        out.append(p.FieldError(name, f"must be true or false, got {text[:40]!r}"))
        return None
    if name in types.structured and text.lstrip()[:1] in ("{", "["):
        try:
            return json.loads(text)
        except ValueError:
            out.append(p.FieldError(name, f"is not valid JSON: {text[:40]!r}"))
            return None
    return text
