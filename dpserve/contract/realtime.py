"""Realtime sessions: what a client sends over the WebSocket, and what the router
relays to the replica that owns the session.

Client side (``/v1/realtime_video/generate``, msgpack binary messages, SGLang's
names): ``init`` opens a session (or ``resume`` attaches to one by id),
``prompt`` changes the prompt, ``step`` asks for one frame in step mode; the
server answers ``init_ack``, then ``frame`` messages whose ``content`` is the
encoded image as msgpack binary, or ``error``.

Router → owner: one ZMQ message kind, :data:`dpserve.contract.protocol.SESSION`, whose
body says the action. A frame travels as its own ZMQ frame, never inside the
header. Parsing is pure and names every bad field, like ``parse_generate``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import msgspec

from dpserve.contract.protocol import (
    INVALID_REQUEST,
    RequestError,
)
from dpserve.contract.validation import (
    MAX_PROMPT_CHARS,
    MAX_SEED,
    OUTPUT_FORMATS,
    FieldChecker,
    Limits,
    check_format,
    check_seeds,
    check_sides,
    invalid_fields,
    parse_size,
)
from dpserve.plumbing.untrusted import MAX_DEPTH, too_deep

# Actions of a SESSION message.
OPEN: Final = "open"
STEP: Final = "step"
RESUME: Final = "resume"
CLOSE: Final = "close"
ACTIONS: Final = frozenset({OPEN, STEP, RESUME, CLOSE})

# Client modes: "stream" renders frames back to back (paced by ``fps`` when
# given); "step" renders one frame per ``step`` message.
MODES: Final = ("stream", "step")
MAX_FIRST_FRAME_BYTES: Final = 8 << 20
MAX_MESSAGE_BYTES: Final = 16 << 20  # the router's WebSocket closes with 1009 above this
MAX_SESSION_ID_CHARS: Final = 200


class SessionParams(msgspec.Struct, frozen=True, kw_only=True):
    """How a session renders; fixed at ``init`` except the prompt."""

    prompt: str
    negative_prompt: str | None = None
    seed: int = 42  # SGLang's default
    width: int | None = None
    height: int | None = None
    num_inference_steps: int | None = None  # the first frame, from noise
    frame_steps: int = 2  # each later frame, from the previous one's latents
    strength: float = 0.5  # how far those latents are re-noised (0: not at all, 1: fully)
    guidance_scale: float | None = None
    true_cfg_scale: float | None = None
    output_format: str = "png"


class SessionRequest(msgspec.Struct, kw_only=True):
    action: str
    session_id: str
    params: SessionParams | None = None  # open
    first_frame: int | None = None  # open: index of the blob holding a starting image
    # step, close: the attachment acting (resume starts a new one); None: whichever.
    # A connection another one took over can neither step nor release the session.
    epoch: int | None = None
    prompt: str | None = None  # step: the prompt from this frame on


class FrameResult(msgspec.Struct, kw_only=True):
    """One rendered frame; the image is blob ``blob`` of the reply."""

    session_id: str
    replica: int
    index: int  # 0 is the frame ``open`` renders
    epoch: int
    blob: int
    format: str
    width: int
    height: int
    inference_time_s: float
    state_bytes: int  # what the session's state takes on the replica


class SessionInfo(msgspec.Struct, kw_only=True):
    """The answer to ``resume`` and ``close``."""

    session_id: str
    replica: int
    epoch: int
    frames: int
    state_bytes: int
    released: bool = False


def session_request(body: Any) -> SessionRequest:
    """Check a decoded SESSION body beyond its types: the action and what it needs."""
    if not isinstance(body, SessionRequest):
        raise RequestError(INVALID_REQUEST, "a session message needs a session body")
    if body.action not in ACTIONS:
        known = ", ".join(sorted(ACTIONS))
        message = f"unknown session action {body.action!r}; known: {known}"
        raise RequestError(INVALID_REQUEST, message)
    if not body.session_id or len(body.session_id) > MAX_SESSION_ID_CHARS:
        raise RequestError(INVALID_REQUEST, "session_id must be a non-empty string")
    if body.action == OPEN and body.params is None:
        raise RequestError(INVALID_REQUEST, "open needs the session's params")
    if body.prompt is not None and len(body.prompt) > MAX_PROMPT_CHARS:
        raise RequestError(INVALID_REQUEST, f"prompt must be at most {MAX_PROMPT_CHARS} characters")
    return body


def check_session(params: SessionParams, limits: Limits) -> None:
    """A session's params as they reach a replica (typed), checked with ``limits``: the
    bounds a generation request gets, every bad field named in one error; then its
    frames' own."""
    check = FieldChecker()
    check.bounded_text("prompt", params.prompt, required=True)
    check.bounded_text("negative_prompt", params.negative_prompt, required=False)
    check_sides(check, params.width, params.height, limits)
    check.count("num_inference_steps", params.num_inference_steps, 1, limits.max_steps)
    check.amount("guidance_scale", params.guidance_scale, 0.0, limits.max_scale)
    check.amount("true_cfg_scale", params.true_cfg_scale, 0.0, limits.max_scale)
    check_seeds(check, [params.seed])
    check_format(check, params.output_format)
    check.raise_errors()
    if not 1 <= params.frame_steps <= limits.max_steps or not 0 < params.strength <= 1:
        raise RequestError(
            INVALID_REQUEST,
            f"frame_steps must be 1..{limits.max_steps} and strength in (0, 1]",
        )


# ---------------------------------------------------------------- client messages


@dataclass(frozen=True)
class StreamOptions:
    """How the router paces a session's frames; none of this reaches the replica."""

    mode: str = "stream"
    fps: float | None = None  # at most this many frames a second (stream mode)
    max_frames: int | None = None  # then the session ends


@dataclass(frozen=True)
class ClientInit:
    params: SessionParams
    options: StreamOptions
    first_frame: bytes | None = None


_INIT_FIELDS: Final = frozenset(
    {
        "type",
        "prompt",
        "negative_prompt",
        "seed",
        "size",
        "width",
        "height",
        "mode",
        "first_frame",
        "num_inference_steps",
        "frame_steps",
        "strength",
        "guidance_scale",
        "true_cfg_scale",
        "output_format",
        "realtime_output_format",  # SGLang's name for output_format
        "fps",
        "max_frames",
        "max_chunks",  # SGLang's name for max_frames
    }
)


_TOO_DEEP: Final = f"a message may nest maps and arrays at most {MAX_DEPTH} levels deep"


def decode_client(raw: bytes | str) -> dict[str, Any]:
    """One client message: a msgpack map with a string ``type``."""
    if isinstance(raw, str):
        raise RequestError(INVALID_REQUEST, "messages must be binary msgpack, not text")
    try:
        message = msgspec.msgpack.decode(raw)
    except msgspec.DecodeError as exc:  # invalid UTF-8 (lone surrogates too) included
        raise RequestError(INVALID_REQUEST, f"message is not valid msgpack: {exc}") from None
    except RecursionError:  # msgspec's own limit, far past ours
        raise RequestError(INVALID_REQUEST, _TOO_DEEP) from None
    if too_deep(message):
        raise RequestError(INVALID_REQUEST, _TOO_DEEP)
    if not isinstance(message, dict):
        raise RequestError(INVALID_REQUEST, "a message must be a msgpack map")
    kind = message.get("type")
    if not isinstance(kind, str):
        raise RequestError(INVALID_REQUEST, 'a message needs a string "type"')
    return message


def parse_init(message: Mapping[str, Any], limits: Limits) -> ClientInit:
    """Validate an ``init`` message; raise :class:`RequestError` naming every bad field."""
    check = FieldChecker(message)
    for key in sorted(str(k) for k in message if k not in _INIT_FIELDS):
        check.bad(key, "is not a known field")
    prompt = check.text("prompt", required=True)
    negative = check.text("negative_prompt", required=False)
    seed = check.integer("seed", 0, MAX_SEED)
    width, height = parse_size(check, limits)
    steps = check.integer("num_inference_steps", 1, limits.max_steps)
    frame_steps = check.integer("frame_steps", 1, limits.max_steps)
    strength = check.number("strength", 0.01, 1.0)
    guidance = check.number("guidance_scale", 0.0, limits.max_scale)
    true_cfg = check.number("true_cfg_scale", 0.0, limits.max_scale)
    fmt = _format(check)
    options = _options(check)
    first = message.get("first_frame")
    if first is not None and not isinstance(first, bytes):
        check.bad("first_frame", "must be the image file's bytes (msgpack bin)")
    elif first is not None and len(first) > MAX_FIRST_FRAME_BYTES:
        check.bad("first_frame", f"must be at most {MAX_FIRST_FRAME_BYTES} bytes")
    if check.errors:
        raise invalid_fields(check.errors)
    assert prompt is not None  # a missing prompt was recorded above
    params = SessionParams(
        prompt=prompt,
        negative_prompt=negative,
        seed=42 if seed is None else seed,
        width=width,
        height=height,
        num_inference_steps=steps,
        frame_steps=frame_steps or 2,
        strength=strength or 0.5,
        guidance_scale=guidance,
        true_cfg_scale=true_cfg,
        output_format=fmt,
    )
    return ClientInit(params, options, first)


def _options(check: FieldChecker) -> StreamOptions:
    mode = check.body.get("mode", "stream")
    if mode not in MODES:
        check.bad("mode", f"must be one of {', '.join(MODES)}, got {mode!r}")
    fps = check.number("fps", 0.01, 1000.0)
    max_frames = _alias_int(check, "max_frames", "max_chunks")
    return StreamOptions(mode=str(mode), fps=fps, max_frames=max_frames)


_RESUME_FIELDS: Final = frozenset({"type", "session_id", "mode", "fps", "max_frames", "max_chunks"})


def parse_resume(message: Mapping[str, Any]) -> tuple[str, StreamOptions]:
    """A ``resume`` message: the session id ``init_ack`` gave, and how to pace it now."""
    check = FieldChecker(message)
    for key in sorted(str(k) for k in message if k not in _RESUME_FIELDS):
        check.bad(key, "is not a known field")
    session_id = message.get("session_id")
    if not isinstance(session_id, str) or not 0 < len(session_id) <= MAX_SESSION_ID_CHARS:
        check.bad("session_id", "must be the session_id that init_ack returned")
    options = _options(check)
    if check.errors:
        raise invalid_fields(check.errors)
    assert isinstance(session_id, str)
    return session_id, options


def _format(check: FieldChecker) -> str:
    for field in ("output_format", "realtime_output_format"):
        value = check.body.get(field)
        if value is None:
            continue
        if value not in OUTPUT_FORMATS:
            check.bad(field, f"must be one of {', '.join(OUTPUT_FORMATS)}, got {value!r}")
            return "png"
        return str(value)
    return "png"


def _alias_int(check: FieldChecker, name: str, alias: str) -> int | None:
    if name in check.body and alias in check.body:
        check.bad(name, f"give either {name} or {alias}, not both")
        return None
    return check.integer(name, 1, 10**9) or check.integer(alias, 1, 10**9)


def parse_prompt(message: Mapping[str, Any]) -> str:
    """A ``prompt`` message: SGLang puts the text in ``action_content``."""
    check = FieldChecker(message)
    field = "action_content" if "action_content" in message else "prompt"
    text = check.text(field, required=True)
    if check.errors:
        raise invalid_fields(check.errors)
    assert text is not None
    return text
