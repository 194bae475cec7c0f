"""Which fields each request route takes: the parser's (dpserve.contract) and the router's own.

The parsers' tables (``validation.GENERATE_SPECS``, ``video.VIDEO_SPECS``) hold the
fields a replica checks too. :data:`ROUTER_FIELDS` holds the rest, the ones the router
reads before the parser (OpenAI's choices and the answer's shape, the peers' names
that ``peers.translate`` turns into ours, an edit form's uploads, a video's
``input_reference``), each with the routes that take it, and the few parser fields a
route documents its own way (a form's ``seed`` is one number). From the two come:
the request models of /openapi.json (``schemas.request_model``), the fields the
parser leaves to the router (:func:`router_only`), and /v1/models'
``request_fields`` (:func:`request_fields`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final, Literal

from dpserve.contract import validation as pv
from dpserve.contract import video
from dpserve.contract.fields import FieldSpec, names
from dpserve.router import peers

# The routes with a request body, by the name /v1/models' request_fields gives them.
GENERATIONS: Final = "generations"  # POST /v1/images/generations, JSON
EDITS: Final = "edits"  # POST /v1/images/edits, a form
VARIATIONS: Final = "variations"  # POST /v1/images/variations, a form
VIDEOS: Final = "videos"  # POST /v1/videos as JSON
VIDEO_FORM: Final = "video_form"  # POST /v1/videos as a form
IMAGES: Final = frozenset({GENERATIONS, EDITS, VARIATIONS})
FORMS: Final = frozenset({EDITS, VARIATIONS})
ADVERTISED: Final = (GENERATIONS, EDITS)  # in /v1/models
_SGLANG_CACHE: Final = 'SGLang\'s: true is step_cache "first_block_cache", false "none"'


@dataclass(frozen=True)
class RouteField:
    spec: FieldSpec
    routes: frozenset[str]


def _on(routes: Iterable[str], spec: FieldSpec) -> RouteField:
    return RouteField(spec, frozenset(routes))


def _images(spec: FieldSpec) -> RouteField:
    return _on(IMAGES, spec)


def _forms(spec: FieldSpec) -> RouteField:
    return _on(FORMS, spec)


ROUTER_FIELDS: Final = (
    # OpenAI's: the answer's shape, and choices among renderings (openai_api.py).
    _images(
        FieldSpec(
            "response_format",
            Literal["b64_json", "url"],
            "b64_json",
            description="url needs the router's --output-store (or --output-dir); not with stream",
        )
    ),
    _images(
        FieldSpec(
            "stream", bool, False, description="answer Server-Sent Events (OpenAI's image events)"
        )
    ),
    # The peers' names (peers.py; docs/router.md, "Fields from other servers").
    _images(FieldSpec("enable_teacache", bool | None, description=_SGLANG_CACHE)),
    _images(FieldSpec("enable_cache_dit", bool | None, description=_SGLANG_CACHE)),
    _images(
        FieldSpec(
            "output_quality",
            Literal[tuple(peers.OUTPUT_QUALITIES)] | None,
            description="SGLang's: output_compression "
            + ", ".join(f"{k} {v}" for k, v in peers.OUTPUT_QUALITIES.items())
            + " (jpeg/webp; a png has none)",
        )
    ),
    _images(
        FieldSpec(
            "generator_device",
            Literal[peers.GENERATOR_DEVICE] | None,
            description="SGLang's: noise is always drawn on the CPU here",
        )
    ),
    _on(
        IMAGES | {VIDEOS, VIDEO_FORM},
        FieldSpec(
            "model",
            str | None,
            description="the served model's name (GET /v1/models); another is a 404",
        ),
    ),
    _images(FieldSpec("user", str | None)),
    _images(FieldSpec("quality", Literal["auto"] | None, description="no tiers: only auto")),
    _images(
        FieldSpec(
            "style", None, description="DALL-E 3's; refused: describe the style in the prompt"
        )
    ),
    _images(
        FieldSpec(
            "background",
            Literal["auto", "opaque"] | None,
            description="images are opaque; transparent is refused",
        )
    ),
    _images(
        FieldSpec("moderation", Literal["auto", "low"] | None, description="nothing is filtered")
    ),
    _images(FieldSpec("safety_identifier", str | None)),
    # An edit's form (forms.py): its uploads and how far the result may go.
    _forms(
        FieldSpec("image", list[bytes] | None, description=f"1-{pv.MAX_EDIT_IMAGES} image files")
    ),
    _on({EDITS}, FieldSpec("image[]", list[bytes] | None, description="same as image")),
    _on({VARIATIONS}, FieldSpec("image[]", None, description="one image: send it as image")),
    _on({EDITS}, FieldSpec("mask", bytes | None)),
    _on({VARIATIONS}, FieldSpec("mask", None, description="refused: inpainting is an edit")),
    _forms(FieldSpec("strength", float | None, gt=0, le=1, description="how far from the input")),
    _forms(FieldSpec("input_fidelity", None, description="refused: strength says how far to go")),
    # Parser fields a route documents its own way: a form's seed is one number (text).
    _forms(
        FieldSpec("seed", int | None, ge=0, le=pv.MAX_SEED, description="image i gets seed + i")
    ),
    _on(
        {VARIATIONS}, FieldSpec("prompt", None, description="refused: with a prompt it is an edit")
    ),
    # A video job's first frame (video_api.py): inline in JSON, a file in a form.
    _on(
        {VIDEOS},
        FieldSpec(
            "input_reference",
            dict[str, str] | None,
            description='{"image_url": "data:image/png;base64,..."}: the first frame',
        ),
    ),
    _on(
        {VIDEO_FORM},
        FieldSpec("input_reference", bytes | None, description="an image file: the first frame"),
    ),
)


def parsed(route: str) -> tuple[FieldSpec, ...]:
    """The parser's fields behind ``route`` (dpserve.contract)."""
    return pv.GENERATE_SPECS if route in IMAGES else video.VIDEO_SPECS


def route_fields(route: str) -> tuple[FieldSpec, ...]:
    """Every field ``route`` takes, in the order its request model shows them: the
    parser's (as the route documents them), then the router's own."""
    own = {f.spec.name: f.spec for f in ROUTER_FIELDS if route in f.routes}
    shared = [own.pop(spec.name, spec) for spec in parsed(route)]
    return (*shared, *own.values())


def router_only(route: str) -> frozenset[str]:
    """The fields of ``route`` the router reads itself: its parser leaves them alone."""
    return names(route_fields(route)) - names(parsed(route))


def request_fields() -> dict[str, list[str]]:
    """Every field each image route takes, as /v1/models advertises them."""
    return {route: sorted(names(route_fields(route))) for route in ADVERTISED}
