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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Final

import msgspec

PROTOCOL_VERSION: Final = 1

# Message kinds, request side.
GENERATE: Final = "generate"
CONTROL: Final = "control"
PING: Final = "ping"
SESSION: Final = (
    "session"  # realtime sessions (dpserve.contract.realtime): open, step, resume, close
)
CANCEL: Final = "cancel"  # nobody waits for an earlier generation any more; never answered
VIDEO: Final = "video"  # video jobs (dpserve.contract.video): submit, get, list, content, delete
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
# A tenant's name (dpserve/router/tenants.py allows 63 characters).
MAX_TENANT: Final = 63


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
    # generate, session: the tenant the request is for, so a cancel by id (which may
    # come through another router) reaches only its own tenant's work
    # (dpserve/contract/owners.py). Omitted: no tenant ("", which only an unscoped
    # cancel reaches); peers that predate it ignore it.
    tenant: Annotated[str, msgspec.Meta(max_length=MAX_TENANT)] = ""


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
    tenant: str = ""  # the header's: whose request it is

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
    """What makes a generation a video (dpserve.contract.video): its frames and their rate.

    As a client asks, ``num_frames`` and ``seconds`` may both be None (the model's
    default length) and ``fps`` None (the model's rate); the replica that accepts
    the job fills all three, so a re-run elsewhere makes the same frames.
    """

    num_frames: int | None = None
    seconds: float | None = None
    fps: int | None = None


class LoraRef(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, forbid_unknown_fields=True
):
    """One LoRA adapter a request applies to itself alone (vLLM-Omni's ``lora``).

    ``name`` is the adapter's identity on every replica: the cache keeps it under that
    name, and a later request may name it alone. ``path`` is where it loads from (a
    folder the replica may read, or a model source); None only for a name the replica
    already knows. ``scale`` is its strength, as ``set_lora``'s.
    """

    name: str
    path: str | None = None
    scale: float = 1.0


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
    # A video job's frames (dpserve.contract.video); None: an image request.
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
    # This request's LoRA adapters, in the order they stack; None: the service's own
    # (its set_lora state). A list, even empty, replaces the service's active adapters
    # for this request only (docs/lora.md).
    lora: list[LoraRef] | None = None


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
    # With any_client: only a request of this tenant is cancelled, another tenant's is
    # not found (None: any tenant's; dpserve/contract/owners.py).
    scope: Annotated[str, msgspec.Meta(max_length=MAX_TENANT)] | None = None


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
    # With a state-changing op, the control state document (dpserve.contract.control_state)
    # the op produced: the replica brings itself to that whole state, not just the
    # op's change, and answers with the op's fields.
    state: dict[str, Any] | None = None


class ControlResult(msgspec.Struct, kw_only=True):
    op: str
    replica: int
    result: dict[str, Any]


class CostReport(msgspec.Struct, kw_only=True):
    """A replica's calibration of the router's cost model (dpserve.contract.cost): what one
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


class AdapterReport(msgspec.Struct, kw_only=True):
    """A replica's LoRA adapter cache, in its pings: what adapter-aware routing reads
    (``resident``, ``load_s``), where a name alone resolves (``known``), and the counts
    the router's /metrics shows. Counters count from the replica's boot."""

    resident: list[str] = msgspec.field(default_factory=list)  # names loaded on the gang now
    pinned: list[str] = msgspec.field(default_factory=list)  # the service's (set_lora) ones
    known: dict[str, str] = msgspec.field(default_factory=dict)  # name -> path, ever loaded
    capacity_bytes: int = 0  # --lora-cache-mb
    used_bytes: int = 0
    load_s: float | None = None  # measured seconds to load one adapter (None: none loaded yet)
    hits: int = 0
    misses: int = 0
    loads: int = 0
    evictions: int = 0
    failures: int = 0  # adapters refused or failed to load
    load_seconds: float = 0.0


class PingResult(msgspec.Struct, kw_only=True):
    replica: int
    boot_id: str  # new on every gang start: a changed id means the replica lost its state
    status: str  # "ok", "draining" or "stalled"
    busy: bool
    queue_depth: int
    served: int
    released: bool
    progress_age_s: float
    # The control state document the replica holds (dpserve.contract.control_state), its
    # state as it really is: routers compare it with the state they want.
    control: dict[str, Any] | None = None
    sessions: int = 0  # realtime sessions held
    max_sessions: int = 0
    session_bytes: int = 0  # memory their state takes, on the driver's rank
    # Load and calibration for cost-aware routing (dpserve.contract.cost, docs/router.md).
    max_batch: int = 1  # generations the gang runs as one pipeline call (--max-batch)
    cost: CostReport | None = None
    outstanding_units: float = 0.0  # cost units queued and running, from every router
    busy_fraction: float = 0.0  # share of the recent window the gang spent on work
    adapters: AdapterReport | None = None  # None: a replica without the adapter cache


# ---------------------------------------------------------------- framing


_ENCODER: Final = msgspec.msgpack.Encoder()


def encode(
    kind: str,
    request_id: str,
    body: Any = None,
    blobs: Sequence[bytes] = (),
    timeout_ms: int | None = None,
    tenant: str = "",
) -> list[bytes]:
    """Frames for one message; ``body`` is a msgspec Struct, a dict or ``None``;
    ``timeout_ms`` the time the request has left (none: no deadline); ``tenant``
    whose request it is."""
    raw = msgspec.Raw(_ENCODER.encode(body if body is not None else {}))
    header = Header(
        v=PROTOCOL_VERSION, id=request_id, kind=kind, body=raw, timeout_ms=timeout_ms, tenant=tenant
    )
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
        tenant=header.tenant,
    )


class _IdOnly(msgspec.Struct):
    """A header's id and nothing else: the decoder skips the other fields unbuilt."""

    id: str | None = None


_ID_ONLY: Final = msgspec.msgpack.Decoder(_IdOnly)


def _salvage_id(raw: bytes) -> str | None:
    """Best effort: the request id of a header whose other fields are broken.

    Typed, so a hostile header costs what reading its bytes does: decoded untyped,
    16 MiB of empty arrays became 16 million lists (about 75 times the frame).
    """
    try:
        return _ID_ONLY.decode(raw).id
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None


def decode_error(message: Message) -> RequestError:
    body: ErrorBody = message.body_as(ErrorBody)
    return RequestError(body.code, body.message, body.fields)
