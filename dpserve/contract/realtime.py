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

from dataclasses import dataclass
from typing import Annotated, Any, Final

import msgspec

from dpserve.contract.protocol import (
    INVALID_REQUEST,
    MAX_TENANT,
    LoraRef,
    RequestError,
)
from dpserve.contract.validation import (
    MAX_PROMPT_CHARS,
    MAX_SEED,
    OUTPUT_FORMATS,
    UPLOAD_FORMAT_NAMES,
    FieldChecker,
    Limits,
    check_format,
    check_loras,
    check_seeds,
    check_sides,
    size_fields,
    upload_format,
)
from dpserve.plumbing.untrusted import MAX_DEPTH

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
    lora: list[LoraRef] | None = None  # the session's own adapters (GenerateParams.lora)


class SessionRequest(msgspec.Struct, kw_only=True):
    action: str
    session_id: str
    params: SessionParams | None = None  # open
    first_frame: int | None = None  # open: index of the blob holding a starting image
    # step, close: the attachment acting (resume starts a new one); None: whichever.
    # A connection another one took over can neither step nor release the session.
    epoch: int | None = None
    prompt: str | None = None  # step: the prompt from this frame on
    # open: the tenant that owns the session, recorded with it. resume: whose sessions
    # the caller may attach to (None: every tenant's; dpserve/contract/owners.py);
    # another tenant's session is not found. Senders that predate tenants send neither.
    tenant: Annotated[str, msgspec.Meta(max_length=MAX_TENANT)] = ""
    scope: Annotated[str, msgspec.Meta(max_length=MAX_TENANT)] | None = None


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
    check_loras(check, params.lora)
    check.raise_errors()
    if not 1 <= params.frame_steps <= limits.max_steps or not 0 < params.strength <= 1:
        raise RequestError(
            INVALID_REQUEST,
            f"frame_steps must be 1..{limits.max_steps} and strength in (0, 1]",
        )


# ---------------------------------------------------------------- client messages

# A client message is a small map; only ``init`` may carry an image (its first
# frame). The router's WebSocket refuses a larger message before reading it (1009):
# frames the server sends are capped apart from these (they are big), and a client
# message is never decoded into untyped Python values, which for 16 MiB of empty
# arrays cost the router 26 s of CPU and 1.2 GB.
MAX_TEXT_MESSAGE_BYTES: Final = 256 << 10  # two prompts of 10,000 characters of 4-byte UTF-8
MAX_MESSAGE_BYTES: Final = MAX_FIRST_FRAME_BYTES + MAX_TEXT_MESSAGE_BYTES  # an init, at most

# Close codes for a message that cannot be read (RFC 6455).
UNREADABLE: Final = 1007  # not a message of the shape its type has
TOO_BIG: Final = 1009


class Malformed(RequestError):
    """A message that is not one of the client messages' shapes: the socket closes
    with ``close_code`` after an ``error`` that says why."""

    def __init__(self, message: str, close_code: int = UNREADABLE) -> None:
        super().__init__(INVALID_REQUEST, message)
        self.close_code = close_code


class InitMessage(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """``init``: opens a session. Values are bounded by :func:`parse_init`."""

    type: str
    model: str | None = None
    prompt: str | None = None  # required; checked with the bounds, so a retry can fix it
    negative_prompt: str | None = None
    seed: int | None = None
    size: str | None = None
    width: int | None = None
    height: int | None = None
    mode: str | None = None
    first_frame: bytes | None = None  # an image file's bytes (msgpack bin)
    num_inference_steps: int | None = None
    frame_steps: int | None = None
    strength: float | None = None
    guidance_scale: float | None = None
    true_cfg_scale: float | None = None
    output_format: str | None = None
    realtime_output_format: str | None = None  # SGLang's name for output_format
    fps: float | None = None
    max_frames: int | None = None
    max_chunks: int | None = None  # SGLang's name for max_frames
    lora: str | LoraRef | list[str | LoraRef] | None = None  # as a generation's (docs/lora.md)


class ResumeMessage(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """``resume``: attaches to a session by the id ``init_ack`` gave."""

    type: str
    session_id: str | None = None
    mode: str | None = None
    fps: float | None = None
    max_frames: int | None = None
    max_chunks: int | None = None


# SGLang's clients may send more than these fields with the messages below: the
# decoder skips the rest without building them.
class PromptMessage(msgspec.Struct, kw_only=True, frozen=True):
    """``prompt``: the prompt from the next frame on; SGLang puts it in ``action_content``."""

    type: str
    action_content: str | None = None
    prompt: str | None = None


class PlainMessage(msgspec.Struct, kw_only=True, frozen=True):
    """``step``, ``close``, ``video``: the type says all the router reads."""

    type: str


ClientMessage = InitMessage | ResumeMessage | PromptMessage | PlainMessage


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


_KIND: Final = msgspec.msgpack.Decoder(PlainMessage)
_DECODERS: Final[dict[str, msgspec.msgpack.Decoder[Any]]] = {
    "init": msgspec.msgpack.Decoder(InitMessage),
    "resume": msgspec.msgpack.Decoder(ResumeMessage),
    "prompt": msgspec.msgpack.Decoder(PromptMessage),
}


def decode_client(raw: bytes | str) -> ClientMessage:
    """One client message, typed by its ``type``: a message of another type than the
    known ones comes back as a :class:`PlainMessage` (the connection says what it takes).

    Raises :class:`Malformed` for anything else: text, more bytes than its type may
    have, not msgpack, not a map with a string ``type``, a field of the wrong type or
    one its type does not have.
    """
    if isinstance(raw, str):
        raise Malformed("messages must be binary msgpack, not text")
    if len(raw) > MAX_MESSAGE_BYTES:  # the server refuses these first; checked here too
        raise Malformed(f"a message may be at most {MAX_MESSAGE_BYTES} bytes", TOO_BIG)
    try:
        kind = _KIND.decode(raw).type
        if kind != "init" and len(raw) > MAX_TEXT_MESSAGE_BYTES:
            limit = MAX_TEXT_MESSAGE_BYTES
            raise Malformed(f"a {kind[:40]!r} message may be at most {limit} bytes", TOO_BIG)
        decoder = _DECODERS.get(kind)
        if decoder is None:
            return PlainMessage(type=kind)
        message: ClientMessage = decoder.decode(raw)
        return message
    except msgspec.ValidationError as exc:
        raise Malformed(f"not a client message: {_shape(exc)}") from None
    except msgspec.DecodeError as exc:  # invalid UTF-8 (lone surrogates too) included
        raise Malformed(f"message is not valid msgpack: {exc}") from None
    except RecursionError:  # msgspec's own limit, met while skipping a field
        raise Malformed(f"a message may nest at most {MAX_DEPTH} levels") from None


def _shape(exc: msgspec.ValidationError) -> str:
    """msgspec's words, in a client's terms: ``object`` is a msgpack map."""
    text = str(exc).replace("`object`", "a msgpack map")[:300]  # it may quote a client's field name
    if "$.type" in text or "missing required field `type`" in text:
        return f'a message is a msgpack map with a string "type" ({text})'
    return text


def parse_init(message: InitMessage, limits: Limits) -> ClientInit:
    """Check an ``init`` message's values; raise :class:`RequestError` naming every bad field."""
    check = FieldChecker()
    prompt = check.bounded_text("prompt", message.prompt, required=True)
    negative = check.bounded_text("negative_prompt", message.negative_prompt, required=False)
    seed = check.count("seed", message.seed, 0, MAX_SEED)
    width, height = size_fields(check, message.size, message.width, message.height, limits)
    steps = check.count("num_inference_steps", message.num_inference_steps, 1, limits.max_steps)
    frame_steps = check.count("frame_steps", message.frame_steps, 1, limits.max_steps)
    strength = check.amount("strength", message.strength, 0.01, 1.0)
    guidance = check.amount("guidance_scale", message.guidance_scale, 0.0, limits.max_scale)
    true_cfg = check.amount("true_cfg_scale", message.true_cfg_scale, 0.0, limits.max_scale)
    fmt = _format(check, message)
    lora = _loras(check, message.lora)
    options = _options(check, message)
    first = message.first_frame
    if first is not None and len(first) > MAX_FIRST_FRAME_BYTES:
        check.bad("first_frame", f"must be at most {MAX_FIRST_FRAME_BYTES} bytes")
    elif first is not None and upload_format(first[:12]) is None:
        check.bad("first_frame", f"must be a {UPLOAD_FORMAT_NAMES} image file's bytes")
    check.raise_errors()
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
        lora=lora,
    )
    return ClientInit(params, options, first)


def _loras(
    check: FieldChecker, raw: str | LoraRef | list[str | LoraRef] | None
) -> list[LoraRef] | None:
    """``init``'s ``lora``, in the forms a generation takes it (a name stands for
    ``{"name": name}``)."""
    if raw is None:
        return None
    items = raw if isinstance(raw, list) else [raw]
    refs = [LoraRef(name=r) if isinstance(r, str) else r for r in items]
    return refs if check_loras(check, refs) else None


def _options(check: FieldChecker, message: InitMessage | ResumeMessage) -> StreamOptions:
    mode = "stream" if message.mode is None else message.mode
    if mode not in MODES:
        check.bad("mode", f"must be one of {', '.join(MODES)}, got {mode[:40]!r}")
    fps = check.amount("fps", message.fps, 0.01, 1000.0)
    frames, chunks = message.max_frames, message.max_chunks
    if frames is not None and chunks is not None:
        check.bad("max_frames", "give either max_frames or max_chunks, not both")
        max_frames = None
    elif chunks is not None:
        max_frames = check.count("max_chunks", chunks, 1, 10**9)
    else:
        max_frames = check.count("max_frames", frames, 1, 10**9)
    return StreamOptions(mode=mode, fps=fps, max_frames=max_frames)


def parse_resume(message: ResumeMessage) -> tuple[str, StreamOptions]:
    """A ``resume`` message: the session id ``init_ack`` gave, and how to pace it now."""
    check = FieldChecker()
    session_id = message.session_id
    if session_id is None or not 0 < len(session_id) <= MAX_SESSION_ID_CHARS:
        check.bad("session_id", "must be the session_id that init_ack returned")
    options = _options(check, message)
    check.raise_errors()
    assert session_id is not None
    return session_id, options


def _format(check: FieldChecker, message: InitMessage) -> str:
    for field, value in (
        ("output_format", message.output_format),
        ("realtime_output_format", message.realtime_output_format),
    ):
        if value is None:
            continue
        if value not in OUTPUT_FORMATS:
            check.bad(field, f"must be one of {', '.join(OUTPUT_FORMATS)}, got {value[:40]!r}")
            return "png"
        return value
    return "png"


def parse_prompt(message: PromptMessage) -> str:
    """A ``prompt`` message: SGLang puts the text in ``action_content``."""
    check = FieldChecker()
    field, value = (
        ("action_content", message.action_content)
        if message.action_content is not None
        else ("prompt", message.prompt)
    )
    text = check.bounded_text(field, value, required=True)
    check.raise_errors()
    assert text is not None
    return text
