"""OpenAI images API on top of the wire contract: request parsing and response shapes."""

from __future__ import annotations

import base64
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import msgspec

from dpserve import protocol as p
from dpserve.router import peers

RESPONSE_FORMATS: Final = ("b64_json", "url")
# OpenAI fields the router handles itself (response_format, stream) or accepts and
# ignores (one model per service; no quality tiers, styles or moderation levels).
OPENAI_ONLY: Final = frozenset(
    {
        "model",
        "response_format",
        "stream",
        "user",
        "quality",
        "style",
        "background",
        "moderation",
        "safety_identifier",
    }
)
# An edit's form also takes these OpenAI fields, accepted and ignored.
EDIT_IGNORED: Final = frozenset({"input_fidelity"})
# An edit's own fields: the uploads (forms.py) and how far the result may go.
EDIT_FIELDS: Final = frozenset({"image", "image[]", "mask", "strength"})


def request_fields() -> dict[str, list[str]]:
    """Every field each image route takes, as /v1/models advertises them."""
    shared = p.GENERATE_FIELDS | OPENAI_ONLY | peers.ACCEPTED
    return {
        "generations": sorted(shared),
        "edits": sorted(shared | EDIT_IGNORED | EDIT_FIELDS),
    }


@dataclass(frozen=True)
class ImageRequest:
    """A validated image request: what the replica gets, and how the answer is shaped."""

    params: p.GenerateParams
    response_format: str
    stream: bool


def parse_image_request(
    body: Any,
    limits: p.Limits,
    can_url: bool,
    features: Mapping[str, Any] | None = None,
    blobs: int | None = None,
    ignore: frozenset[str] = frozenset(),
) -> ImageRequest:
    """The validated request; every bad field is named.

    ``blobs``: an edit, whose body names its uploads in ``edit``. ``features``: the
    replicas' (model_info); previews past what they can make are capped there (OpenAI
    allows fewer previews than asked), and only a stream gets previews at all.
    """
    fmt = body.get("response_format", "b64_json") if isinstance(body, dict) else "b64_json"
    stream = body.get("stream", False) if isinstance(body, dict) else False
    problems: list[p.FieldError] = []
    if not isinstance(stream, bool):
        problems.append(p.FieldError("stream", f"must be true or false, got {stream!r}"))
        stream = False
    if fmt not in RESPONSE_FORMATS:
        problems.append(p.FieldError("response_format", f"must be b64_json or url, got {fmt!r}"))
    elif fmt == "url" and stream:
        problems.append(
            p.FieldError(
                "response_format",
                "url cannot be streamed (stream events carry b64_json, as OpenAI's do); "
                "use b64_json or drop stream",
            )
        )
    elif fmt == "url" and not can_url:
        problems.append(
            p.FieldError(
                "response_format",
                "url needs an output store (start the router with --output-dir); use b64_json",
            )
        )
    params: p.GenerateParams | None = None
    body, peer_problems = peers.translate(body)
    problems += peer_problems
    try:
        params = p.parse_generate(body, limits, ignore=OPENAI_ONLY | ignore, blobs=blobs)
    except p.RequestError as exc:
        if not exc.fields:
            raise
        problems = [*exc.fields, *problems]
    if problems or params is None:
        raise p.invalid_fields(problems)
    partials = params.partial_images if stream else 0
    if features is not None:
        partials = min(partials, int(features.get("partial_images", p.MAX_PARTIAL_IMAGES)))
    if partials != params.partial_images:
        params = msgspec.structs.replace(params, partial_images=partials)
    return ImageRequest(params, str(fmt), stream)


def size_of(width: int, height: int) -> str:
    return f"{width}x{height}"


def check_edit_supported(features: dict[str, Any] | None, masked: bool) -> None:
    """Refuse an edit the served model cannot do, as its features say (None: not known
    yet, and the replica decides)."""
    if features is None:
        return
    if not features.get("edits", False):
        raise p.RequestError(
            p.UNSUPPORTED,
            "this model serves no edits (its pipeline has no image-to-image or inpainting "
            "form; see GET /v1/models features)",
            [p.FieldError("image", "edits are not supported by the served model")],
        )
    if masked and not features.get("inpainting", False):
        raise p.RequestError(
            p.UNSUPPORTED,
            "this model cannot inpaint: send the edit without a mask",
            [p.FieldError("mask", "inpainting is not supported by the served model")],
        )


def image_response(
    request_id: str,
    result: p.GenerateResult,
    images: list[bytes],
    urls: list[str] | None,
) -> dict[str, Any]:
    data: list[dict[str, Any]] = []
    for i, meta in enumerate(result.images):
        item: dict[str, Any] = {"seed": meta.seed}
        if urls is not None:
            item["url"] = urls[i]
        else:
            item["b64_json"] = base64.b64encode(images[i]).decode()
        data.append(item)
    first = result.images[0] if result.images else None
    return {
        "id": request_id,
        "created": int(time.time()),
        "data": data,
        "output_format": first.format if first else None,
        "size": size_of(first.width, first.height) if first else None,
        "inference_time_s": result.inference_time_s,
        "encode_time_s": result.encode_time_s,
        "queue_time_s": result.queue_time_s,
        "peak_memory_mb": result.peak_memory_mb,
    }


_ERROR_TYPES: Final = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


def error_body(
    status: int,
    message: str,
    fields: list[p.FieldError] | None = None,
    request_id: str | None = None,
) -> dict[str, Any]:
    """OpenAI's error shape, plus every bad field for clients that want them all, and
    the request's id where it has one."""
    error: dict[str, Any] = {
        "message": message,
        "type": _ERROR_TYPES.get(
            status, "invalid_request_error" if status < 500 else "server_error"
        ),
        "param": fields[0].field if fields else None,
        "code": status,
    }
    if fields:
        error["fields"] = [{"field": f.field, "message": f.message} for f in fields]
    return {"error": error} if request_id is None else {"id": request_id, "error": error}
