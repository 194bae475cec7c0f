"""The wire contract between the router (DEALER) and a replica's driver (ROUTER).

A message is a list of ZMQ frames ``[header, *blobs]``. The header is msgpack
(msgspec) carrying the protocol version, a request id, a kind, a body and, for
work with a deadline, the time it has left; binary payloads (images, frames)
travel as their own frames and the body refers to them by index. Nothing on the
wire is pickled, so a peer can never make the other side run code. Decoding never
raises anything but :class:`ProtocolError`, whatever the bytes, so a malformed
message can be answered or dropped without taking the driver down.
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Final

import msgspec

PROTOCOL_VERSION: Final = 1

# Message kinds, request side.
GENERATE: Final = "generate"
CONTROL: Final = "control"
PING: Final = "ping"
SESSION: Final = "session"  # realtime sessions (dpserve.realtime): open, step, resume, close
CANCEL: Final = "cancel"  # nobody waits for an earlier generation any more; never answered
VIDEO: Final = "video"  # video jobs (dpserve.video): submit, get, list, content, delete
REQUEST_KINDS: Final = frozenset({GENERATE, CONTROL, PING, SESSION, CANCEL, VIDEO})
# Message kinds, reply side.
RESULT: Final = "result"
ERROR: Final = "error"
# An interim reply to a generation that asked for previews (partial_images > 0):
# any number come before its one final result or error, under the same id.
PARTIAL: Final = "partial"

# Error codes and the HTTP status a front end should map them to.
INVALID_REQUEST: Final = "invalid_request"
UNSUPPORTED: Final = "unsupported"
OVERLOADED: Final = "overloaded"
CONFLICT: Final = "conflict"
NOT_FOUND: Final = "not_found"
UNAVAILABLE: Final = "unavailable"
INTERNAL: Final = "internal"
CANCELLED: Final = "cancelled"  # its client cancelled it (or went away) before it finished
DEADLINE_EXCEEDED: Final = "deadline_exceeded"  # its deadline passed before it finished
HTTP_STATUS: Final[Mapping[str, int]] = {
    INVALID_REQUEST: 400,
    UNSUPPORTED: 400,
    OVERLOADED: 429,
    CONFLICT: 409,
    NOT_FOUND: 404,
    UNAVAILABLE: 503,
    INTERNAL: 500,
    CANCELLED: 499,  # nginx's "client closed request": nobody reads the answer
    DEADLINE_EXCEEDED: 504,
}

# Control operations a replica understands (SGLang's names). State-changing ops
# must reach every replica; read-only ones may be answered by any.
SYNC_STATE: Final = "sync_state"  # the router's: bring a replica to a whole control state
MUTATING_OPS: Final = frozenset(
    {
        "update_weights_from_disk",
        "set_lora",
        "merge_lora_weights",
        "unmerge_lora_weights",
        "release_memory_occupation",
        "resume_memory_occupation",
        SYNC_STATE,
    }
)
READ_ONLY_OPS: Final = frozenset({"model_info", "list_loras", "get_weights_checksum"})
CONTROL_OPS: Final = MUTATING_OPS | READ_ONLY_OPS

MAX_SEED: Final = 2**63 - 1
MAX_PROMPT_CHARS: Final = 10_000
OUTPUT_FORMATS: Final = ("png", "jpeg", "webp")
COMPRESSIBLE_FORMATS: Final = ("jpeg", "webp")  # output_compression applies to these
MAX_PARTIAL_IMAGES: Final = 3  # OpenAI's bound on previews per image
# A request's text length and scheduler shift, before the replica's own bounds
# (its features: max_sequence_length, flow_shift) narrow them.
MAX_SEQUENCE_LENGTH: Final = 4096
FLOW_SHIFT_RANGE: Final = (0.01, 100.0)
# Edits: the images (and mask) a request may upload, each checked before it queues.
MAX_EDIT_IMAGES: Final = 16
MAX_EDIT_IMAGE_BYTES: Final = 8 << 20  # per file, like a realtime session's first frame
MAX_EDIT_PIXELS: Final = 4096 * 4096  # per image; read from its header before decoding
# Step caches (docs/worker.md "Step caching"): each kind a request may name, with its
# one knob and the knob's bounds; "none" turns off the service's default for a request.
STEP_CACHE_OFF: Final = "none"
STEP_CACHE_KNOBS: Final[Mapping[str, tuple[str, float, float]]] = {
    "first_block_cache": ("threshold", 0.0, 1.0),  # relative change of the first block
    "taylorseer": ("interval", 2, 50),  # steps from one full computation to the next
}
_MSGPACK_EMPTY_MAP: Final = b"\x80"
# Frame size caps (zmq.MAXMSGSIZE, per frame): a peer that sends a bigger frame is
# disconnected by libzmq before the frame is buffered whole. A request's biggest
# legitimate frame is a realtime session's first frame (realtime.MAX_FIRST_FRAME_BYTES,
# 8 MiB); headers hold prompts (MAX_PROMPT_CHARS, at most 40 KB of UTF-8) and control
# states (names and paths): kilobytes. Twice the first frame leaves headroom.
MAX_REQUEST_FRAME_BYTES: Final = 16 << 20
# A reply's biggest frame is one image. Uncompressed 8-bit RGB (a PNG of noise is
# barely bigger) takes 3 * side**2 bytes: 12 MiB at the default max_side 2048, 48 MiB
# at 4096. 64 MiB covers a worker's --max-side up to 4096 with room to spare.
MAX_REPLY_FRAME_BYTES: Final = 64 << 20


class ProtocolError(Exception):
    """A message that cannot be understood; ``request_id`` is set when it could be read."""

    def __init__(self, message: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


class Header(msgspec.Struct, kw_only=True, forbid_unknown_fields=False, omit_defaults=True):
    v: int
    id: str
    kind: str
    body: msgspec.Raw = msgspec.Raw(_MSGPACK_EMPTY_MAP)
    # The time the sender still gives the request, in ms at sending (gRPC's timeout
    # header): a relative time, because the two ends' clocks differ. Omitted: no
    # deadline. Peers that predate it ignore it (unknown fields are allowed).
    timeout_ms: Annotated[int, msgspec.Meta(ge=0)] | None = None


class FieldError(msgspec.Struct, frozen=True):
    field: str
    message: str


class ErrorBody(msgspec.Struct, kw_only=True):
    code: str
    message: str
    fields: list[FieldError] = msgspec.field(default_factory=list)


class RequestError(Exception):
    """A request the replica refuses, with the code a front end maps to HTTP."""

    def __init__(
        self, code: str, message: str, fields: Sequence[FieldError] = (), status: int | None = None
    ) -> None:
        super().__init__(message)
        self.code = code
        self.fields = list(fields)
        self.status = status if status is not None else HTTP_STATUS.get(code, 500)

    def body(self) -> ErrorBody:
        return ErrorBody(code=self.code, message=str(self), fields=self.fields)


@dataclass(frozen=True)
class Message:
    """A decoded message: the header's fields and the raw blobs after it."""

    id: str
    kind: str
    body: msgspec.Raw
    blobs: tuple[bytes, ...]
    timeout_ms: int | None = None  # the header's: time left for the request when it was sent

    def body_as(self, type_: type[Any]) -> Any:
        try:
            return msgspec.msgpack.decode(self.body, type=type_)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
            raise ProtocolError(f"invalid {self.kind} body: {exc}", self.id) from exc


# ---------------------------------------------------------------- generation


class EditInput(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """An edit's inputs: indexes of the message's blobs (encoded image files).

    With a mask, the model's inpainting pipeline repaints where the mask is white;
    without, its image-to-image (or edit) pipeline starts from the images.
    ``strength`` (0, 1]: how far from the input the result may go (None: the
    pipeline's default).
    """

    images: list[int]
    mask: int | None = None
    strength: float | None = None


class StepCache(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A step cache asked for: ``type`` is a ``STEP_CACHE_KNOBS`` kind or "none"; the
    kind's knob (``threshold`` or ``interval``) is None for the replica's default."""

    type: str
    threshold: float | None = None
    interval: int | None = None


class VideoSpec(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What makes a generation a video (dpserve.video): its frames and their rate.

    As a client asks, ``num_frames`` and ``seconds`` may both be None (the model's
    default length) and ``fps`` None (the model's rate); the replica that accepts
    the job fills all three, so a re-run elsewhere makes the same frames.
    """

    num_frames: int | None = None
    seconds: float | None = None
    fps: int | None = None


class GenerateParams(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A validated generation request; ``None`` means "the model's default"."""

    prompt: str
    negative_prompt: str | None = None
    n: int = 1
    width: int | None = None
    height: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    true_cfg_scale: float | None = None
    seed: list[int] | None = None
    output_format: str = "png"
    # jpeg/webp quality, 0-100 (OpenAI's name); None: the format's fixed default.
    output_compression: int | None = None
    # Previews per image, sent as PARTIAL replies at evenly spread denoising steps.
    partial_images: int = 0
    edit: EditInput | None = None
    # None: the replica's default step cache (its --step-cache); STEP_CACHE_OFF: none.
    step_cache: StepCache | None = None
    # A video job's frames (dpserve.video); None: an image request.
    video: VideoSpec | None = None
    # Text tokens the prompt is padded or cut to (the pipeline's max_sequence_length);
    # None: the service's (--max-sequence-length, else the pipeline's default).
    max_sequence_length: int | None = None
    # The scheduler's shift s for this request (sigma -> s*sigma / (1 + (s-1)*sigma));
    # None: the scheduler's own (Flux's depends on the image size).
    flow_shift: float | None = None
    # Decode in tiles, or one image at a time: less memory, slightly different pixels.
    vae_use_tiling: bool = False
    vae_use_slicing: bool = False


class PartialImage(msgspec.Struct, frozen=True, kw_only=True):
    """Body of a PARTIAL reply: one preview, decoded from the current prediction.

    ``image`` is the image's place in the request (0..n-1), ``index`` the preview's
    number for that image (0..partial_images-1), taken after denoising step
    ``step`` of ``steps``; the encoded preview is blob ``blob``.
    """

    image: int
    index: int
    step: int
    steps: int
    blob: int
    format: str
    width: int
    height: int


class ImageMeta(msgspec.Struct, frozen=True, kw_only=True):
    index: int
    blob: int
    seed: int
    format: str
    width: int
    height: int


class GenerateResult(msgspec.Struct, kw_only=True):
    images: list[ImageMeta]
    replica: int
    inference_time_s: float  # the pipeline, without encoding
    queue_time_s: float
    peak_memory_mb: float
    encode_time_s: float = 0.0  # encoding every image to its format


@dataclass(frozen=True)
class Limits:
    """Bounds a request is checked against; a replica fills ``size_factor`` from its model."""

    max_n: int = 10
    min_side: int = 16
    max_side: int = 2048
    size_factor: int = 16
    max_steps: int = 100
    max_scale: float = 100.0
    # Sequence-parallel ranks: the image tokens, one per size_factor x size_factor
    # patch, must split evenly over them.
    sequence_split: int = 1
    # Video models (dpserve.video): frame counts are frame_factor * k + 1, at most
    # max_frames; max_frames 0 means the model makes no videos.
    max_frames: int = 0
    frame_factor: int = 4
    default_frames: int = 81
    default_fps: int = 16


def invalid_fields(errors: Sequence[FieldError]) -> RequestError:
    """One error naming every bad field and what is wrong with it."""
    detail = "; ".join(f"{e.field} {e.message}" for e in errors)
    return RequestError(INVALID_REQUEST, f"invalid request: {detail}", errors)


_SIZE_RE: Final = re.compile(r"^(\d{1,5})x(\d{1,5})$")


class FieldChecker:
    """Collects every bad field of a request, so one reply names them all."""

    def __init__(self, body: Mapping[str, Any]) -> None:
        self.body = body
        self.errors: list[FieldError] = []

    def bad(self, field: str, message: str) -> None:
        self.errors.append(FieldError(field, message))

    def text(self, field: str, *, required: bool) -> str | None:
        value = self.body.get(field)
        if value is None:
            if required:
                self.bad(field, "is required")
            return None
        if not isinstance(value, str):
            self.bad(field, f"must be a string, got {type(value).__name__}")
            return None
        if len(value) > MAX_PROMPT_CHARS:
            self.bad(field, f"must be at most {MAX_PROMPT_CHARS} characters")
            return None
        return value

    def integer(self, field: str, low: int, high: int) -> int | None:
        value = self.body.get(field)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            self.bad(field, f"must be an integer, got {type(value).__name__}")
            return None
        if not low <= value <= high:
            self.bad(field, f"must be between {low} and {high}, got {value}")
            return None
        return value

    def number(self, field: str, low: float, high: float) -> float | None:
        value = self.body.get(field)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            self.bad(field, f"must be a number, got {type(value).__name__}")
            return None
        if not low <= float(value) <= high:
            self.bad(field, f"must be between {low:g} and {high:g}, got {value}")
            return None
        return float(value)

    def boolean(self, field: str) -> bool | None:
        value = self.body.get(field)
        if value is None or isinstance(value, bool):
            return value
        self.bad(field, f"must be true or false, got {type(value).__name__}")
        return None

    def side(self, field: str, limits: Limits) -> int | None:
        value = self.integer(field, limits.min_side, limits.max_side)
        if value is not None and value % limits.size_factor:
            self.bad(field, f"must be a multiple of {limits.size_factor}, got {value}")
            return None
        return value


def parse_size(check: FieldChecker, limits: Limits) -> tuple[int | None, int | None]:
    width = check.side("width", limits)
    height = check.side("height", limits)
    size = check.body.get("size")
    if size is None or size == "auto":
        _check_tokens(check, width, height, limits, "width")
        return width, height
    match = _SIZE_RE.match(size) if isinstance(size, str) else None
    if match is None:
        check.bad("size", f'must look like "1024x1024", got {size!r}')
        return width, height
    if "width" in check.body or "height" in check.body:
        check.bad("size", "give either size or width/height, not both")
        return width, height
    sized = FieldChecker({"width": int(match[1]), "height": int(match[2])})
    width, height = sized.side("width", limits), sized.side("height", limits)
    check.errors += [FieldError("size", f"{e.field} {e.message}") for e in sized.errors]
    _check_tokens(check, width, height, limits, "size")
    return width, height


def _check_tokens(
    check: FieldChecker, width: int | None, height: int | None, limits: Limits, field: str
) -> None:
    """Under sequence parallel, a size whose token count the ranks cannot split is refused,
    naming sizes near it that work."""
    split, factor = limits.sequence_split, limits.size_factor
    if split == 1 or width is None or height is None:
        return
    tokens = (width // factor) * (height // factor)
    if tokens % split == 0:
        return
    near = sorted(
        {
            (w, h)
            for w in (width - factor, width, width + factor)
            for h in (height - 2 * factor, height - factor, height, height + factor)
            if limits.min_side <= min(w, h)
            and max(w, h) <= limits.max_side
            and ((w // factor) * (h // factor)) % split == 0
        },
        key=lambda wh: (abs(wh[0] - width) + abs(wh[1] - height), wh),
    )
    hint = ", ".join(f"{w}x{h}" for w, h in near[:3]) or f"{factor * split}x{factor * split}"
    check.bad(
        field,
        f"{width}x{height} has {tokens} image tokens ({factor}x{factor} patches), which the "
        f"{split} sequence-parallel ranks cannot split evenly: use a size whose "
        f"(width/{factor})*(height/{factor}) is a multiple of {split}, e.g. {hint}",
    )


def _parse_seeds(check: FieldChecker, n: int) -> list[int] | None:
    seed = check.body.get("seed")
    if seed is None:
        return None
    seeds = [seed] if not isinstance(seed, list) else seed
    if not seeds or any(isinstance(s, bool) or not isinstance(s, int) for s in seeds):
        check.bad("seed", "must be an integer or a non-empty list of integers")
        return None
    if any(not 0 <= s <= MAX_SEED for s in seeds):
        check.bad("seed", f"must be between 0 and {MAX_SEED}")
        return None
    if isinstance(seed, list) and len(seeds) != n:
        check.bad("seed", f"a list of seeds needs one per image: got {len(seeds)} for n={n}")
        return None
    # One int seeds image i with seed + i, so n images of one request differ.
    return seeds if isinstance(seed, list) else [(seed + i) % (MAX_SEED + 1) for i in range(n)]


GENERATE_FIELDS: Final = frozenset(
    {
        "prompt",
        "negative_prompt",
        "n",
        "width",
        "height",
        "size",
        "num_inference_steps",
        "guidance_scale",
        "true_cfg_scale",
        "seed",
        "output_format",
        "output_compression",
        "partial_images",
        "step_cache",
        "max_sequence_length",
        "flow_shift",
        "vae_use_tiling",
        "vae_use_slicing",
    }
)


def parse_generate(
    body: Any, limits: Limits, ignore: frozenset[str] = frozenset(), blobs: int | None = None
) -> GenerateParams:
    """Validate a generation body; raise :class:`RequestError` naming every bad field.

    ``ignore`` lists extra fields a front end accepts and handles itself (for
    example the OpenAI ``model`` or ``response_format`` fields). ``blobs`` is the
    number of binary frames that came with the body: only then may it hold an
    ``edit`` naming them (a JSON body from a client never does).
    """
    if not isinstance(body, Mapping):
        raise RequestError(INVALID_REQUEST, "the request body must be an object")
    check = FieldChecker(body)
    known = GENERATE_FIELDS | ignore | ({"edit"} if blobs is not None else set())
    unknown = sorted(str(k) for k in body if k not in known)
    for key in unknown:
        check.bad(key, "is not a known field")
    prompt = check.text("prompt", required=True)
    negative = check.text("negative_prompt", required=False)
    n = check.integer("n", 1, limits.max_n)
    width, height = parse_size(check, limits)
    steps = check.integer("num_inference_steps", 1, limits.max_steps)
    guidance = check.number("guidance_scale", 0.0, limits.max_scale)
    true_cfg = check.number("true_cfg_scale", 0.0, limits.max_scale)
    seeds = _parse_seeds(check, n or 1)
    fmt = body.get("output_format", "png")
    if fmt not in OUTPUT_FORMATS:
        check.bad("output_format", f"must be one of {', '.join(OUTPUT_FORMATS)}, got {fmt!r}")
    compression = check.integer("output_compression", 0, 100)
    if compression is not None and fmt in OUTPUT_FORMATS and fmt not in COMPRESSIBLE_FORMATS:
        check.bad("output_compression", f"applies to jpeg and webp only, not {fmt}")
    partials = check.integer("partial_images", 0, MAX_PARTIAL_IMAGES)
    edit = _parse_edit(check, blobs) if blobs is not None else None
    step_cache = parse_step_cache(check, check.body.get("step_cache"))
    text_length = check.integer("max_sequence_length", 1, MAX_SEQUENCE_LENGTH)
    flow_shift = check.number("flow_shift", *FLOW_SHIFT_RANGE)
    tiling, slicing = check.boolean("vae_use_tiling"), check.boolean("vae_use_slicing")
    if check.errors:
        raise invalid_fields(check.errors)
    assert prompt is not None  # a missing prompt was recorded as an error above
    return GenerateParams(
        prompt=prompt,
        negative_prompt=negative,
        n=n or 1,
        width=width,
        height=height,
        num_inference_steps=steps,
        guidance_scale=guidance,
        true_cfg_scale=true_cfg,
        seed=seeds,
        output_format=fmt,
        output_compression=compression,
        partial_images=partials or 0,
        edit=edit,
        step_cache=step_cache,
        max_sequence_length=text_length,
        flow_shift=flow_shift,
        vae_use_tiling=bool(tiling),
        vae_use_slicing=bool(slicing),
    )


def parse_step_cache(check: FieldChecker, raw: Any) -> StepCache | None:
    """``step_cache``: a kind's name (its default knob), ``{"type": kind, knob: value}``,
    or "none". A knob given as null is left out, as a null field is anywhere in a request.
    Which kinds a replica offers is its own check (worker/step_cache.py)."""
    if raw is None:
        return None
    kinds = ", ".join([*STEP_CACHE_KNOBS, STEP_CACHE_OFF])
    if isinstance(raw, Mapping):
        raw = {k: v for k, v in raw.items() if v is not None}
    body = {"type": raw} if isinstance(raw, str) else raw
    kind = body.get("type") if isinstance(body, Mapping) else None
    if not isinstance(kind, str) or (kind != STEP_CACHE_OFF and kind not in STEP_CACHE_KNOBS):
        shape = 'a name or {"type": name, ...}'
        check.bad("step_cache", f"must be {shape} with a name of {kinds}, got {raw!r}")
        return None
    assert isinstance(body, Mapping)
    knob, low, high = STEP_CACHE_KNOBS.get(kind, ("", 0.0, 0.0))
    extra = sorted(str(k) for k in body if k not in ("type", knob))
    if extra:
        takes = f"takes only {knob}" if knob else "takes no settings"
        check.bad("step_cache", f"{kind} {takes}, not {', '.join(extra)}")
        return None
    value = body.get(knob)
    is_int = knob == "interval"
    if value is not None and (
        isinstance(value, bool)
        or not isinstance(value, int if is_int else int | float)
        or not low <= value <= high
    ):
        what = "an integer" if is_int else "a number"
        check.bad("step_cache", f"{kind}'s {knob} must be {what} in [{low:g}, {high:g}]")
        return None
    if value is None:
        return StepCache(type=kind)
    if is_int:
        return StepCache(type=kind, interval=int(value))
    return StepCache(type=kind, threshold=float(value))


def _parse_edit(check: FieldChecker, blobs: int) -> EditInput | None:
    raw = check.body.get("edit")
    if raw is None:
        return None
    try:
        edit = msgspec.convert(raw, EditInput)
    except msgspec.ValidationError as exc:
        check.bad("edit", f"is malformed: {exc}")
        return None
    named = [*edit.images, *([edit.mask] if edit.mask is not None else [])]
    if not 1 <= len(edit.images) <= MAX_EDIT_IMAGES:
        check.bad("image", f"must be 1 to {MAX_EDIT_IMAGES} images, got {len(edit.images)}")
    elif any(not 0 <= i < blobs for i in named) or len(set(named)) != len(named):
        check.bad("edit", f"must name distinct blobs of the message's {blobs}")
    elif edit.strength is not None and not 0.0 < edit.strength <= 1.0:
        check.bad("strength", f"must be in (0, 1], got {edit.strength:g}")
    else:
        return edit
    return None


def fill_seeds(params: GenerateParams) -> GenerateParams:
    """Pick a seed per image when the client gave none, and keep them.

    Whoever fixes the seeds first (router or driver) makes every later step
    reproducible: the gang's ranks draw the same noise and a retry on another
    replica returns the same bytes.
    """
    if params.seed is not None:
        return params
    base = random.SystemRandom().randrange(MAX_SEED - params.n)
    return msgspec.structs.replace(params, seed=[base + i for i in range(params.n)])


# ---------------------------------------------------------------- cancellation


class CancelRequest(msgspec.Struct, kw_only=True):
    """Body of a ``cancel``: the id of an earlier ``generate`` sent on the same connection.

    Never answered itself; the named request, if still queued or running, is answered
    ``cancelled`` (queued: at once; running: at its next denoising step).

    With ``any_client`` the request is looked for among every client's (a router
    cancelling, by id, a request another router admitted), and the cancel is
    answered with a :class:`CancelResult`.
    """

    request_id: str
    any_client: bool = False


CANCEL_QUEUED: Final = "queued"
CANCEL_RUNNING: Final = "running"
CANCEL_NOT_FOUND: Final = "not_found"


class CancelResult(msgspec.Struct, kw_only=True):
    """Answer to an ``any_client`` cancel: where the request was (CANCEL_*)."""

    request_id: str
    found: str


# ---------------------------------------------------------------- control and ping


class ControlRequest(msgspec.Struct, kw_only=True):
    op: str
    args: dict[str, Any] = msgspec.field(default_factory=dict)
    # With a state-changing op, the control state document (dpserve.control_state)
    # the op produced: the replica brings itself to that whole state, not just the
    # op's change, and answers with the op's fields.
    state: dict[str, Any] | None = None


class ControlResult(msgspec.Struct, kw_only=True):
    op: str
    replica: int
    result: dict[str, Any]


class CostReport(msgspec.Struct, kw_only=True):
    """A replica's calibration of the router's cost model (dpserve.cost): what one
    cost unit takes on this gang, as measured, and the sizes a request that names
    none gets."""

    seconds_per_unit: float | None = None  # None until a generation was measured
    samples: int = 0
    default_width: int = 1024
    default_height: int = 1024
    default_steps: int = 28
    default_true_cfg_scale: float = 1.0  # the pipeline's, for a request that names none
    # Per denoising step, the megapixels' worth of work the prompt's text tokens add
    # (joint attention over text and image tokens; 0: the prompt is not in the sequence).
    text_megapixels: float = 0.0
    # The pipeline's guidance_scale where it is classifier-free guidance (Wan, SD3);
    # None where CFG is true_cfg_scale (Flux, Qwen-Image).
    default_guidance_scale: float | None = None
    # Video models: frames per latent frame after the first, and a job's default length.
    frame_factor: int = 4
    default_frames: int = 1


class PingResult(msgspec.Struct, kw_only=True):
    replica: int
    boot_id: str  # new on every gang start: a changed id means the replica lost its state
    status: str  # "ok", "draining" or "stalled"
    busy: bool
    queue_depth: int
    served: int
    released: bool
    progress_age_s: float
    # The control state document the replica holds (dpserve.control_state), its
    # state as it really is: routers compare it with the state they want.
    control: dict[str, Any] | None = None
    sessions: int = 0  # realtime sessions held
    max_sessions: int = 0
    session_bytes: int = 0  # memory their state takes, on the driver's rank
    # Load and calibration for cost-aware routing (dpserve.cost, docs/router.md).
    max_batch: int = 1  # generations the gang runs as one pipeline call (--max-batch)
    cost: CostReport | None = None
    outstanding_units: float = 0.0  # cost units queued and running, from every router
    busy_fraction: float = 0.0  # share of the recent window the gang spent on work


def parse_control(body: ControlRequest) -> ControlRequest:
    if body.op not in CONTROL_OPS:
        known = ", ".join(sorted(CONTROL_OPS))
        raise RequestError(
            UNSUPPORTED,
            f"unknown control op {body.op!r}; known ops: {known}",
            [FieldError("op", "is not a known control op")],
        )
    return body


# ---------------------------------------------------------------- framing


_ENCODER: Final = msgspec.msgpack.Encoder()


def encode(
    kind: str,
    request_id: str,
    body: Any = None,
    blobs: Sequence[bytes] = (),
    timeout_ms: int | None = None,
) -> list[bytes]:
    """Frames for one message; ``body`` is a msgspec Struct, a dict or ``None``;
    ``timeout_ms`` the time the request has left (none: no deadline)."""
    raw = msgspec.Raw(_ENCODER.encode(body if body is not None else {}))
    header = Header(v=PROTOCOL_VERSION, id=request_id, kind=kind, body=raw, timeout_ms=timeout_ms)
    return [_ENCODER.encode(header), *blobs]


def encode_error(request_id: str, error: RequestError) -> list[bytes]:
    return encode(ERROR, request_id, error.body())


def decode(frames: Sequence[bytes]) -> Message:
    """Decode ``[header, *blobs]``; any defect raises :class:`ProtocolError`."""
    if not frames:
        raise ProtocolError("empty message")
    try:
        header = msgspec.msgpack.decode(frames[0], type=Header)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
        raise ProtocolError(f"unreadable header: {exc}", _salvage_id(frames[0])) from exc
    if header.v != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version {header.v} is not supported (this side speaks {PROTOCOL_VERSION})",
            header.id,
        )
    return Message(
        id=header.id,
        kind=header.kind,
        body=header.body,
        blobs=tuple(frames[1:]),
        timeout_ms=header.timeout_ms,
    )


def _salvage_id(raw: bytes) -> str | None:
    """Best effort: the request id of a header whose other fields are broken."""
    try:
        value = msgspec.msgpack.decode(raw)
    except (msgspec.DecodeError, ValueError, TypeError, RecursionError):
        return None
    ident = value.get("id") if isinstance(value, dict) else None
    return ident if isinstance(ident, str) else None


def decode_error(message: Message) -> RequestError:
    body: ErrorBody = message.body_as(ErrorBody)
    return RequestError(body.code, body.message, body.fields)
