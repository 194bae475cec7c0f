"""How a generation request's fields are checked: the same rules on both sides of the wire.

The router checks a request before it queues it, against the limits the serving replicas
report (dpserve.contract.model_info); the driver checks it again against its own, since a
replica never trusts a peer. Every bad field is named in one ``invalid_request`` error, so a
client fixes them all at once.
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

import msgspec

from dpserve.contract.fields import FieldSpec, names
from dpserve.contract.protocol import (
    CONTROL_OPS,
    INVALID_REQUEST,
    UNSUPPORTED,
    ControlRequest,
    EditInput,
    FieldError,
    GenerateParams,
    LoraRef,
    RequestError,
    StepCache,
)

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
# The image files an upload may be (an edit's images and mask, a video's reference, a
# realtime first frame), by Pillow's names: the formats clients send, and far fewer
# decoders exposed to hostile files than all Pillow knows.
UPLOAD_FORMATS: Final = ("PNG", "JPEG", "WEBP")
UPLOAD_FORMAT_NAMES: Final = "PNG, JPEG or WebP"
# Step caches (docs/worker.md "Step caching"): each kind a request may name, with its
# one knob and the knob's bounds; "none" turns off the service's default for a request.
STEP_CACHE_OFF: Final = "none"
STEP_CACHE_KNOBS: Final[Mapping[str, tuple[str, float, float]]] = {
    "first_block_cache": ("threshold", 0.0, 1.0),  # relative change of the first block
    "taylorseer": ("interval", 2, 50),  # steps from one full computation to the next
}
# Per-request LoRA adapters (docs/lora.md): how many one request stacks, a name's
# shape (it is a cache key and a metrics label), and a scale's bounds.
MAX_REQUEST_LORAS: Final = 8
LORA_NAME_RE: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
LORA_SCALE_RANGE: Final = (-10.0, 10.0)
MAX_LORA_PATH_CHARS: Final = 4096


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
    # Video models (dpserve.contract.video): frame counts are frame_factor * k + 1, at most
    # max_frames; max_frames 0 means the model makes no videos.
    max_frames: int = 0
    frame_factor: int = 4
    default_frames: int = 81
    default_fps: int = 16


def upload_format(head: bytes) -> str | None:
    """The format of an image file whose first 12 bytes are ``head``, by its signature,
    if it is one of ``UPLOAD_FORMATS``; None otherwise. Nothing is decoded."""
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if head.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "WEBP"
    return None


def invalid_fields(errors: Sequence[FieldError]) -> RequestError:
    """One error naming every bad field and what is wrong with it."""
    detail = "; ".join(f"{e.field} {e.message}" for e in errors)
    return RequestError(INVALID_REQUEST, f"invalid request: {detail}", errors)


_SIZE_RE: Final = re.compile(r"^(\d{1,5})x(\d{1,5})$")


class FieldChecker:
    """Collects every bad field of a request, so one reply names them all.

    Two layers: the readers (``text``, ``integer``, ``number``, ``side``) take a field
    of a decoded ``body`` and check its type, then its bounds with the bound checks
    (``bounded_text``, ``count``, ``amount``, ``side_of``), which take a typed value.
    A request that arrives typed (a video job's or a session's params) is checked
    with the bound checks alone, so each bound is one implementation.
    """

    def __init__(self, body: Mapping[str, Any] | None = None) -> None:
        self.body: Mapping[str, Any] = body if body is not None else {}
        self.errors: list[FieldError] = []

    def bad(self, field: str, message: str) -> None:
        self.errors.append(FieldError(field, message))

    def raise_errors(self) -> None:
        if self.errors:
            raise invalid_fields(self.errors)

    # ------------------------------------------------------------ readers of a body

    def text(self, field: str, *, required: bool) -> str | None:
        value = self.body.get(field)
        if value is not None and not isinstance(value, str):
            self.bad(field, f"must be a string, got {type(value).__name__}")
            return None
        return self.bounded_text(field, value, required=required)

    def integer(self, field: str, low: int, high: int) -> int | None:
        value = self.body.get(field)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            self.bad(field, f"must be an integer, got {type(value).__name__}")
            return None
        return self.count(field, value, low, high)

    def number(self, field: str, low: float, high: float) -> float | None:
        value = self.body.get(field)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            self.bad(field, f"must be a number, got {type(value).__name__}")
            return None
        return self.amount(field, value, low, high)

    def boolean(self, field: str) -> bool | None:
        value = self.body.get(field)
        if value is None or isinstance(value, bool):
            return value
        self.bad(field, f"must be true or false, got {type(value).__name__}")
        return None

    def side(self, field: str, limits: Limits) -> int | None:
        value = self.integer(field, limits.min_side, limits.max_side)
        return self.side_of(field, value, limits, bounded=True)

    # ------------------------------------------------------------ bounds of a typed value

    def bounded_text(self, field: str, value: str | None, *, required: bool) -> str | None:
        if value is None:
            if required:
                self.bad(field, "is required")
            return None
        if len(value) > MAX_PROMPT_CHARS:
            self.bad(field, f"must be at most {MAX_PROMPT_CHARS} characters")
            return None
        return value

    def count(self, field: str, value: int | None, low: int, high: int) -> int | None:
        if value is not None and not low <= value <= high:
            self.bad(field, f"must be between {low} and {high}, got {value}")
            return None
        return value

    def amount(self, field: str, value: float | None, low: float, high: float) -> float | None:
        if value is None:
            return None
        if not low <= float(value) <= high:
            self.bad(field, f"must be between {low:g} and {high:g}, got {value}")
            return None
        return float(value)

    def side_of(
        self, field: str, value: int | None, limits: Limits, *, bounded: bool = False
    ) -> int | None:
        """A width or height: within the limits (``bounded``: checked already) and a
        multiple of the model's size factor."""
        if not bounded:
            value = self.count(field, value, limits.min_side, limits.max_side)
        if value is not None and value % limits.size_factor:
            self.bad(field, f"must be a multiple of {limits.size_factor}, got {value}")
            return None
        return value


def parse_size(check: FieldChecker, limits: Limits) -> tuple[int | None, int | None]:
    width = check.side("width", limits)
    height = check.side("height", limits)
    given = "width" in check.body or "height" in check.body
    return _sized(check, check.body.get("size"), width, height, given, limits)


def size_fields(
    check: FieldChecker,
    size: str | None,
    width: int | None,
    height: int | None,
    limits: Limits,
) -> tuple[int | None, int | None]:
    """``parse_size`` for a request that arrives typed (a realtime ``init``)."""
    given = width is not None or height is not None
    width, height = check.side_of("width", width, limits), check.side_of("height", height, limits)
    return _sized(check, size, width, height, given, limits)


def _sized(
    check: FieldChecker,
    size: Any,
    width: int | None,
    height: int | None,
    given: bool,
    limits: Limits,
) -> tuple[int | None, int | None]:
    """``size`` ("WxH" or "auto") against width/height checked already (``given``: sent)."""
    if size is None or size == "auto":
        _check_tokens(check, width, height, limits, "width")
        return width, height
    match = _SIZE_RE.match(size) if isinstance(size, str) else None
    if match is None:
        check.bad("size", f'must look like "1024x1024", got {str(size)[:40]!r}')
        return width, height
    if given:
        check.bad("size", "give either size or width/height, not both")
        return width, height
    sized = FieldChecker({"width": int(match[1]), "height": int(match[2])})
    width, height = sized.side("width", limits), sized.side("height", limits)
    check.errors += [FieldError("size", f"{e.field} {e.message}") for e in sized.errors]
    _check_tokens(check, width, height, limits, "size")
    return width, height


def check_sides(
    check: FieldChecker, width: int | None, height: int | None, limits: Limits
) -> tuple[int | None, int | None]:
    """A typed width and height: the bounds ``parse_size`` gives the fields."""
    width, height = check.side_of("width", width, limits), check.side_of("height", height, limits)
    _check_tokens(check, width, height, limits, "width")
    return width, height


def check_size(width: int, height: int, limits: Limits) -> None:
    """A size the replica chose (an edit's, from its first image) meets every bound a
    given one does; raise naming each side that does not."""
    check = FieldChecker()
    check_sides(check, width, height, limits)
    check.raise_errors()


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
    if not check_seeds(check, seeds):
        return None
    if isinstance(seed, list) and len(seeds) != n:
        check.bad("seed", f"a list of seeds needs one per image: got {len(seeds)} for n={n}")
        return None
    # One int seeds image i with seed + i, so n images of one request differ.
    return seeds if isinstance(seed, list) else [(seed + i) % (MAX_SEED + 1) for i in range(n)]


def check_seeds(check: FieldChecker, seeds: Sequence[int]) -> bool:
    """Typed seeds within their range (else the field is named)."""
    if any(not 0 <= s <= MAX_SEED for s in seeds):
        check.bad("seed", f"must be between 0 and {MAX_SEED}")
        return False
    return True


def check_format(check: FieldChecker, fmt: Any) -> bool:
    """An output format this service encodes (else the field is named)."""
    if fmt not in OUTPUT_FORMATS:
        check.bad("output_format", f"must be one of {', '.join(OUTPUT_FORMATS)}, got {fmt!r}")
        return False
    return True


# A generation's fields, in the order /openapi.json shows them; the router adds the ones
# it reads itself (dpserve/router/fields.py). The checks are parse_generate's.
PROMPT: Final = FieldSpec("prompt", str, required=True, max_length=MAX_PROMPT_CHARS)
NEGATIVE_PROMPT: Final = FieldSpec("negative_prompt", str | None, max_length=MAX_PROMPT_CHARS)
WIDTH: Final = FieldSpec("width", int | None, description="instead of size, with height")
HEIGHT: Final = FieldSpec("height", int | None)
STEPS: Final = FieldSpec("num_inference_steps", int | None, ge=1, le=Limits.max_steps)
GUIDANCE: Final = FieldSpec("guidance_scale", float | None, ge=0, le=Limits.max_scale)
LORA: Final = FieldSpec(
    "lora",
    str | dict[str, str | float | None] | list[dict[str, str | float | None]] | None,
    description='LoRA adapters for this request only: {"name": "ink", "path": "/models/ink", '
    '"scale": 0.8}, a list of them (stacked in order), or a known name alone ("ink"); '
    "[] for none. Replaces the service's active adapters for this request (docs/lora.md)",
)
GENERATE_SPECS: Final = (
    PROMPT,
    NEGATIVE_PROMPT,
    FieldSpec("n", int, 1, ge=1, le=Limits.max_n, description="images in this request"),
    FieldSpec(
        "size",
        str | None,
        description='"WIDTHxHEIGHT" (multiples of the model\'s size factor) or "auto"',
    ),
    WIDTH,
    HEIGHT,
    STEPS,
    GUIDANCE,
    FieldSpec("true_cfg_scale", float | None, ge=0, le=Limits.max_scale),
    FieldSpec(
        "seed",
        int | list[int] | None,
        description="one seed (image i gets seed + i) or one per image",
        ge=0,
        le=MAX_SEED,
    ),
    FieldSpec("output_format", Literal[OUTPUT_FORMATS], OUTPUT_FORMATS[0]),
    FieldSpec(
        "output_compression",
        int | None,
        ge=0,
        le=100,
        description="jpeg/webp quality (0-100); not for png",
    ),
    FieldSpec(
        "partial_images",
        int,
        0,
        ge=0,
        le=MAX_PARTIAL_IMAGES,
        description="previews per image, with stream",
    ),
    FieldSpec(
        "step_cache",
        str | dict[str, str | float | None] | None,
        description='a step cache for this request: "first_block_cache" or "taylorseer" '
        '(its default knob), {"type": "first_block_cache", "threshold": 0.08}, '
        '{"type": "taylorseer", "interval": 3}, or "none" (off, whatever the service\'s '
        "default); which ones a service offers: GET /v1/models features.step_caches",
    ),
    FieldSpec(
        "max_sequence_length",
        int | None,
        ge=1,
        le=MAX_SEQUENCE_LENGTH,
        description="text tokens the prompt is padded or cut to; at most "
        "features.max_sequence_length.max (null there: the model takes none)",
    ),
    FieldSpec(
        "flow_shift",
        float | None,
        ge=FLOW_SHIFT_RANGE[0],
        le=FLOW_SHIFT_RANGE[1],
        description="the flow-matching schedule's shift s (sigma -> s*sigma/(1+(s-1)*sigma)), "
        "instead of the scheduler's own; where features.flow_shift is not null",
    ),
    FieldSpec("vae_use_tiling", bool, False, description="decode in tiles (less memory)"),
    FieldSpec(
        "vae_use_slicing", bool, False, description="decode one image at a time (less memory)"
    ),
    LORA,
)
GENERATE_FIELDS: Final = names(GENERATE_SPECS)


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
    check_format(check, fmt)
    compression = check.integer("output_compression", 0, 100)
    if compression is not None and fmt in OUTPUT_FORMATS and fmt not in COMPRESSIBLE_FORMATS:
        check.bad("output_compression", f"applies to jpeg and webp only, not {fmt}")
    partials = check.integer("partial_images", 0, MAX_PARTIAL_IMAGES)
    edit = _parse_edit(check, blobs) if blobs is not None else None
    step_cache = parse_step_cache(check, check.body.get("step_cache"))
    text_length = check.integer("max_sequence_length", 1, MAX_SEQUENCE_LENGTH)
    flow_shift = check.number("flow_shift", *FLOW_SHIFT_RANGE)
    tiling, slicing = check.boolean("vae_use_tiling"), check.boolean("vae_use_slicing")
    lora = parse_lora(check, check.body.get("lora"))
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
        lora=lora,
    )


def parse_lora(check: FieldChecker, raw: Any) -> list[LoraRef] | None:
    """``lora`` as a client writes it: ``{"name", "path", "scale"}``, a list of those, or
    a name alone; null is "the service's adapters", ``[]`` "none". The typed bounds are
    :func:`check_loras`'."""
    if raw is None:
        return None
    items = raw if isinstance(raw, list) else [raw]
    refs: list[LoraRef] = []
    for i, item in enumerate(items):
        where = f"lora[{i}]" if isinstance(raw, list) else "lora"
        if isinstance(item, str):
            item = {"name": item}
        if not isinstance(item, Mapping):
            check.bad(where, 'must be {"name": ..., "path": ..., "scale": ...} or a name')
            return None
        item = {k: v for k, v in item.items() if v is not None}
        extra = sorted(str(k) for k in item if k not in ("name", "path", "scale"))
        name, path, scale = item.get("name"), item.get("path"), item.get("scale", 1.0)
        if extra:
            check.bad(where, f"takes name, path and scale, not {', '.join(extra)}")
        elif not isinstance(name, str) or not isinstance(path, str | None):
            check.bad(where, "name (and path, where given) must be strings")
        elif isinstance(scale, bool) or not isinstance(scale, int | float):
            check.bad(where, f"scale must be a number, got {type(scale).__name__}")
        else:
            refs.append(LoraRef(name=name, path=path, scale=float(scale)))
            continue
        return None
    return refs if check_loras(check, refs) else None


def check_loras(check: FieldChecker, refs: Sequence[LoraRef] | None) -> bool:
    """Typed adapters within their bounds (else ``lora`` is named): at most
    ``MAX_REQUEST_LORAS``, each name once and of ``LORA_NAME_RE``'s shape, a scale in
    ``LORA_SCALE_RANGE``. Whether a path may be read is the replica's check."""
    if refs is None:
        return True
    low, high = LORA_SCALE_RANGE
    problems = []
    if len(refs) > MAX_REQUEST_LORAS:
        problems.append(f"takes at most {MAX_REQUEST_LORAS} adapters, got {len(refs)}")
    names_seen = [r.name for r in refs]
    if len(set(names_seen)) != len(names_seen):
        problems.append("names an adapter twice")
    for ref in refs:
        if not LORA_NAME_RE.match(ref.name):
            problems.append(
                f"name {ref.name[:70]!r} must be 1-64 letters, digits, '.', '_' or '-', "
                "starting with a letter or digit"
            )
        if ref.path is not None and not 0 < len(ref.path) <= MAX_LORA_PATH_CHARS:
            problems.append(f"{ref.name}'s path must be 1 to {MAX_LORA_PATH_CHARS} characters")
        if not low <= ref.scale <= high:
            problems.append(f"{ref.name}'s scale must be between {low:g} and {high:g}")
    for problem in problems:
        check.bad("lora", problem)
    return not problems


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


def parse_control(body: ControlRequest) -> ControlRequest:
    if body.op not in CONTROL_OPS:
        known = ", ".join(sorted(CONTROL_OPS))
        raise RequestError(
            UNSUPPORTED,
            f"unknown control op {body.op!r}; known ops: {known}",
            [FieldError("op", "is not a known control op")],
        )
    return body
