"""OpenAI images API on top of the wire contract: request parsing and response shapes."""

from __future__ import annotations

import base64
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import msgspec

from dpserve.contract import protocol as p
from dpserve.contract import validation as pv
from dpserve.contract.model_info import Features
from dpserve.router import fields, peers
from dpserve.router.served_model import MODEL_NOT_FOUND, check_model

RESPONSE_FORMATS: Final = ("b64_json", "url")
# The fields of each image route the router handles itself (the model's name, the
# answer's shape, the choices below, the peers' names, an edit's uploads): the
# generation's parser leaves them alone.
_ROUTER_ONLY: Final = {route: fields.router_only(route) for route in fields.IMAGES}
# OpenAI's choices among renderings: the values this server honours (what every image
# here is). Any other value would change the image, so it is refused, naming the field
# and what to send instead, never ignored. moderation changes no pixel (this server
# filters nothing), so both of OpenAI's levels are taken; user and safety_identifier
# (_TEXT) are any string.
_CHOICES: Final[Mapping[str, tuple[tuple[str, ...], str]]] = {
    "background": (
        ("auto", "opaque"),
        "this model renders opaque images only: send opaque or auto, or leave it out",
    ),
    "quality": (
        ("auto",),
        "this server has no quality tiers (num_inference_steps sets the work per image): "
        "send auto or leave it out",
    ),
    "style": ((), "is DALL-E 3's and this model has no styles: describe the style in the prompt"),
    "input_fidelity": (
        (),
        "is not supported: strength (0-1] says how far the result may go from the input",
    ),
    "moderation": (("auto", "low"), "must be auto or low"),
}
_TEXT: Final = ("user", "safety_identifier")
# OpenAI's completed images carry token usage; a diffusion model counts no tokens.
NO_USAGE: Final = {
    "input_tokens": 0,
    "input_tokens_details": {"image_tokens": 0, "text_tokens": 0},
    "output_tokens": 0,
    "total_tokens": 0,
}
BACKGROUND: Final = "opaque"  # every image this server makes


@dataclass(frozen=True)
class ImageRequest:
    """A validated image request: what the replica gets, and how the answer is shaped."""

    params: p.GenerateParams
    response_format: str
    stream: bool


def parse_image_request(
    body: Any,
    limits: pv.Limits,
    can_url: bool,
    features: Features | None = None,
    blobs: int | None = None,
    route: str = fields.GENERATIONS,
    served: str | None = None,
) -> ImageRequest:
    """The validated request; every bad field is named.

    ``blobs``: an edit, whose body names its uploads in ``edit``; ``route``: which
    image route it came by (dpserve/router/fields.py). ``features``: the
    replicas' (model_info); previews past what they can make are capped there (OpenAI
    allows fewer previews than asked), and only a stream gets previews at all.
    ``served``: the served model's name (None: not known yet); a request naming
    another model is a 404 before anything else is looked at.
    """
    if isinstance(body, dict):
        check_model(body.get("model"), served)
    fmt = body.get("response_format", "b64_json") if isinstance(body, dict) else "b64_json"
    stream = body.get("stream", False) if isinstance(body, dict) else False
    problems: list[p.FieldError] = openai_choices(body) if isinstance(body, dict) else []
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
                "url needs an output store (start the router with --output-store or "
                "--output-dir); use b64_json",
            )
        )
    params: p.GenerateParams | None = None
    body, peer_problems = peers.translate(body)
    problems += peer_problems
    try:
        params = pv.parse_generate(body, limits, ignore=_ROUTER_ONLY[route], blobs=blobs)
    except p.RequestError as exc:
        if not exc.fields:
            raise
        problems = [*exc.fields, *problems]
    if problems or params is None:
        raise pv.invalid_fields(problems)
    partials = params.partial_images if stream else 0
    if features is not None:
        partials = min(partials, features.partial_images)
    if partials != params.partial_images:
        params = msgspec.structs.replace(params, partial_images=partials)
    return ImageRequest(params, str(fmt), stream)


def openai_choices(body: Mapping[str, Any]) -> list[p.FieldError]:
    """OpenAI's rendering choices this server cannot honour, each named (``_CHOICES``)."""
    problems = []
    for name, (honoured, why) in _CHOICES.items():
        value = body.get(name)
        if value is not None and value not in honoured:
            shown = value[:40] if isinstance(value, str) else type(value).__name__
            problems.append(p.FieldError(name, f"{shown!r} {why}" if honoured else why))
    for name in _TEXT:
        value = body.get(name)
        if value is not None and not isinstance(value, str):
            problems.append(p.FieldError(name, f"must be a string, got {type(value).__name__}"))
    return problems


def size_of(width: int, height: int) -> str:
    return f"{width}x{height}"


def check_edit_supported(features: Features | None, masked: bool) -> None:
    """Refuse an edit the served model cannot do, as its features say (None: not known
    yet, and the replica decides)."""
    if features is None:
        return
    if not features.edits:
        raise p.RequestError(
            p.UNSUPPORTED,
            "this model serves no edits (its pipeline has no image-to-image or inpainting "
            "form; see GET /v1/models features)",
            [p.FieldError("image", "edits are not supported by the served model")],
        )
    if masked and not features.inpainting:
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
    # The openai client's ImagesResponse: background, quality (null: OpenAI's answer
    # names a tier, and this server has none), output_format, size and usage.
    return {
        "id": request_id,
        "created": int(time.time()),
        "data": data,
        "background": BACKGROUND,
        "quality": None,
        "output_format": first.format if first else None,
        "size": size_of(first.width, first.height) if first else None,
        "usage": NO_USAGE,
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
# error.code: why, as a short string a client can branch on (OpenAI's where it has
# one). A replica's refusal keeps its wire code (dpserve.contract.protocol); the router's own by
# status; a refusal naming fields is invalid_value (unsupported_value: the model
# cannot do it).
_STATUS_CODES: Final = {
    400: p.INVALID_REQUEST,
    401: "invalid_api_key",
    403: "permission_denied",
    404: p.NOT_FOUND,
    405: "method_not_allowed",
    408: "request_timeout",
    409: p.CONFLICT,
    413: "request_too_large",
    415: "unsupported_media_type",
    421: "misdirected_request",
    429: p.OVERLOADED,
    499: p.CANCELLED,
    500: p.INTERNAL,
    503: p.UNAVAILABLE,
    504: p.DEADLINE_EXCEEDED,
}
_WITH_FIELDS: Final = {p.INVALID_REQUEST: "invalid_value", p.UNSUPPORTED: "unsupported_value"}
# A bug's answer (a 500, the traceback logged): no word of the exception reaches the
# client (it may hold paths or state).
INTERNAL_MESSAGE: Final = "internal error in the router; it is logged there"
ERROR_CODES: Final = frozenset(
    {*_STATUS_CODES.values(), *_WITH_FIELDS.values(), p.UNSUPPORTED, MODEL_NOT_FOUND}
)


def error_code(status: int, code: str | None, fields: bool) -> str | None:
    """``error.code`` for a failure: ``code`` (the wire's, or the router's own such as
    model_not_found) refined where fields are named; else the status's."""
    code = code or _STATUS_CODES.get(status)
    return _WITH_FIELDS.get(code, code) if fields and code is not None else code


def error_body(
    status: int,
    message: str,
    fields: list[p.FieldError] | None = None,
    request_id: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    """OpenAI's error shape, plus every bad field for clients that want them all, and
    the request's id. The one shape of every error the router answers."""
    error: dict[str, Any] = {
        "message": message,
        "type": _ERROR_TYPES.get(
            status, "invalid_request_error" if status < 500 else "server_error"
        ),
        "param": fields[0].field if fields else None,
        "code": error_code(status, code, bool(fields)),
        "fields": [{"field": f.field, "message": f.message} for f in fields or ()],
    }
    return {"error": error} if request_id is None else {"id": request_id, "error": error}
