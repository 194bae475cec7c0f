"""An edit's multipart form: parsed from bytes already read (within the upload limit),
its text fields turned into the typed body the generation parser checks.

The router never decodes an image (it has no Pillow): it checks counts and byte
sizes, and the replica's driver checks the pixels and the mask's size before the
request queues, answering 400s that name the upload.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any, Final

from starlette.datastructures import Headers, UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser

from dpserve.contract import protocol as p
from dpserve.contract import validation as pv
from dpserve.router.bodies import BadBody
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


async def form_items(
    raw: bytes, content_type: str, max_files: int
) -> list[tuple[str, UploadFile | str]]:
    """A whole multipart body's parts, in order; a malformed one is a 400."""

    async def stream() -> AsyncGenerator[bytes, None]:
        yield raw

    parser = MultiPartParser(
        Headers({"content-type": content_type}),
        stream(),
        max_files=max_files,
        max_fields=_MAX_FIELDS,
        max_part_size=_MAX_FIELD_BYTES,
    )
    try:
        return (await parser.parse()).multi_items()
    except MultiPartException as exc:
        raise BadBody(400, f"malformed {FORM_TYPE} body: {exc}") from None


async def parse_form(raw: bytes, content_type: str | None) -> EditForm:
    if not is_form(content_type):
        got = f"got {content_type!r}" if content_type else "got none"
        raise BadBody(415, f"send an edit as {FORM_TYPE} (OpenAI's edit form; {got})")
    assert content_type is not None
    items = await form_items(raw, content_type, max_files=pv.MAX_EDIT_IMAGES + 1)
    form = EditForm()
    problems: list[p.FieldError] = []
    for name, value in items:
        if isinstance(value, UploadFile):
            data = await value.read()
            await value.close()
            _file(form, name, value.filename or name, data, problems)
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


def _file(form: EditForm, name: str, filename: str, data: bytes, out: list[p.FieldError]) -> None:
    if name not in (*IMAGE_FIELDS, MASK_FIELD):
        out.append(p.FieldError(name, "is not a known field (files go in image, image[], mask)"))
    elif len(data) > pv.MAX_EDIT_IMAGE_BYTES:
        limit = pv.MAX_EDIT_IMAGE_BYTES >> 20
        out.append(p.FieldError(name, f"{filename!r} is {len(data)} bytes; at most {limit} MiB"))
    elif not data:
        out.append(p.FieldError(name, f"{filename!r} is empty"))
    elif name == MASK_FIELD:
        if form.mask is not None:
            out.append(p.FieldError(name, "give one mask"))
        form.mask = data
    elif len(form.images) >= pv.MAX_EDIT_IMAGES:
        out.append(p.FieldError(name, f"at most {pv.MAX_EDIT_IMAGES} images per edit"))
    else:
        form.images.append(data)


def _typed(name: str, text: str, out: list[p.FieldError]) -> Any:
    """A form string as its field's type; unknown fields stay text (the parser names them)."""
    return typed_value(name, text, out, EDIT_TYPES)


def typed_value(name: str, text: str, out: list[p.FieldError], types: FormTypes) -> Any:
    """A form string as the type its field has in ``types`` (others stay text); a bad
    one is recorded in ``out`` and comes back None."""
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
    return text
