"""OpenAI images API on top of the wire contract: request parsing and response shapes."""

from __future__ import annotations

import base64
import time
from typing import Any, Final

from dpserve import protocol as p

RESPONSE_FORMATS: Final = ("b64_json", "url")
# OpenAI fields a front end accepts but that do not reach a replica.
OPENAI_ONLY: Final = frozenset({"model", "response_format", "user", "quality", "style"})


def parse_image_request(body: Any, limits: p.Limits, can_url: bool) -> tuple[p.GenerateParams, str]:
    """The validated request and its response format; every bad field is named."""
    fmt = body.get("response_format", "b64_json") if isinstance(body, dict) else "b64_json"
    problems: list[p.FieldError] = []
    if fmt not in RESPONSE_FORMATS:
        problems.append(p.FieldError("response_format", f"must be b64_json or url, got {fmt!r}"))
    elif fmt == "url" and not can_url:
        problems.append(
            p.FieldError(
                "response_format",
                "url needs an output store (start the router with --output-dir); use b64_json",
            )
        )
    params: p.GenerateParams | None = None
    try:
        params = p.parse_generate(body, limits, ignore=OPENAI_ONLY)
    except p.RequestError as exc:
        if not exc.fields:
            raise
        problems = [*exc.fields, *problems]
    if problems or params is None:
        raise p.invalid_fields(problems)
    return params, str(fmt)


def image_response(
    result: p.GenerateResult, images: list[bytes], urls: list[str] | None
) -> dict[str, Any]:
    data: list[dict[str, Any]] = []
    for i, meta in enumerate(result.images):
        item: dict[str, Any] = {"seed": meta.seed}
        if urls is not None:
            item["url"] = urls[i]
        else:
            item["b64_json"] = base64.b64encode(images[i]).decode()
        data.append(item)
    return {
        "created": int(time.time()),
        "data": data,
        "inference_time_s": result.inference_time_s,
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
    status: int, message: str, fields: list[p.FieldError] | None = None
) -> dict[str, Any]:
    """OpenAI's error shape, plus every bad field for clients that want them all."""
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
    return {"error": error}
