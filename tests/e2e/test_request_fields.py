"""Every request field `/v1/models` advertises, sent through `dpserve serve` (real
HTTP, the router, a real worker with the tiny Flux model) and checked for its effect.

The cases are keyed by field. Each test reads what the served model advertises
(``router_features.request_fields``, and ``features`` for what the model takes) and
fails when an advertised field has no case, so a field that starts being advertised
comes with its end-to-end check; a case for a field no longer advertised fails too.
Generations send JSON, edits the multipart form (only text values there).

Why this exists: per-request ``step_cache`` was documented, advertised and tested in
the worker, yet a 400 through the router in every form, because no test sent it the
way a user does (tests/unit/test_generate_wire.py holds the wire half).
"""

from __future__ import annotations

import base64
import io
import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from PIL import Image

from tests.pixels import psnr_db
from tests.servers import ServeProcess

pytestmark = [pytest.mark.e2e, pytest.mark.rest_lane]  # no machine-wide resource (conftest)

# Eight steps: TaylorSeer computes its first three in full, then predicts between.
BASE: dict[str, Any] = {
    "prompt": "a red fox",
    "size": "64x64",
    "num_inference_steps": 8,
    "seed": 5,
}
EDIT_BASE: dict[str, Any] = {"prompt": "a red fox", "num_inference_steps": 12, "seed": 5}
MAGIC = {"png": b"\x89PNG", "jpeg": b"\xff\xd8\xff", "webp": b"RIFF"}
# The tuned service's defaults: a first-block cache that skips on random weights,
# and a shorter text.
TUNED_THRESHOLD, TUNED_TEXT = 1.0, 128


def _png(size: tuple[int, int], hue: int) -> bytes:
    """A gradient, so an edit has structure to keep."""
    img = Image.new("RGB", size)
    img.putdata(
        [((x * 4 + hue) % 256, (y * 4) % 256, 128) for y in range(size[1]) for x in range(size[0])]
    )
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _mask(size: tuple[int, int]) -> bytes:
    img = Image.new("L", size, 0)
    img.paste(255, (size[0] // 2, 0, size[0], size[1]))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


SOURCE, OTHER_SOURCE, MASK = _png((64, 64), 0), _png((64, 64), 120), _mask((64, 64))


@pytest.fixture(scope="module")
def plain(tiny_model: Path, allow_tmp: tuple[str, str]) -> Iterator[ServeProcess]:
    with ServeProcess(tiny_model, 1, *allow_tmp) as running:  # the lora case's adapter
        yield running


@pytest.fixture(scope="module")
def tuned(tiny_model: Path) -> Iterator[ServeProcess]:
    """A service-wide step cache and text length: what a request's own must equal."""
    flags = ("--step-cache", "first_block_cache", "--step-cache-threshold", str(TUNED_THRESHOLD))
    with ServeProcess(tiny_model, 1, *flags, "--max-sequence-length", str(TUNED_TEXT)) as running:
        yield running


@dataclass
class Route:
    """One image route of a served model, as a client calls it."""

    http: httpx.Client
    edit: bool
    model: dict[str, Any]  # the /v1/models entry
    _base: bytes | None = field(default=None, repr=False)

    @property
    def features(self) -> dict[str, Any]:
        return dict(self.model["features"])

    @property
    def advertised(self) -> list[str]:
        return list(self.model["router_features"]["request_fields"][self.kind])

    @property
    def kind(self) -> str:
        return "edits" if self.edit else "generations"

    def post(self, files: dict[str, Any] | None = None, **fields: Any) -> httpx.Response:
        """The route's answer to its base request with ``fields`` (None: left out)."""
        body = {**(EDIT_BASE if self.edit else BASE), **fields}
        body = {k: v for k, v in body.items() if v is not None}
        if not self.edit:
            return self.http.post("/v1/images/generations", json=body)
        form = {k: _form_text(k, v) for k, v in body.items()}
        upload = files if files is not None else {"image": ("in.png", SOURCE, "image/png")}
        return self.http.post("/v1/images/edits", data=form, files=upload)

    def images(self, files: dict[str, Any] | None = None, **fields: Any) -> list[bytes]:
        answer = self.post(files, **fields)
        assert answer.status_code == 200, answer.text
        return [base64.b64decode(item["b64_json"]) for item in answer.json()["data"]]

    def image(self, files: dict[str, Any] | None = None, **fields: Any) -> bytes:
        return self.images(files, **fields)[0]

    @property
    def base(self) -> bytes:
        if self._base is None:
            self._base = self.image()
        return self._base

    def refused(self, field_name: str, says: str, **fields: Any) -> None:
        answer = self.post(**fields)
        assert answer.status_code == 400, answer.text
        named = {f["field"]: f["message"] for f in answer.json()["error"]["fields"]}
        assert says in named.get(field_name, ""), named

    def events(self, **fields: Any) -> list[tuple[str, dict[str, Any]]]:
        """A streamed answer's events, in order."""
        answer = self.post(stream=True, **fields)
        assert answer.status_code == 200, answer.text
        out = []
        for chunk in answer.text.split("\n\n"):
            lines = dict(line.split(": ", 1) for line in chunk.splitlines() if ": " in line)
            if "data" in lines:
                out.append((lines.get("event", ""), json.loads(lines["data"])))
        return out


def _form_text(name: str, value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    assert isinstance(value, str | int | float), f"{name}: a form carries text only"
    return str(value)


def _decoded(data: bytes) -> Image.Image:
    img = Image.open(io.BytesIO(data))
    img.load()
    return img


def _size_shift(width: int, height: int, model_dir: Path) -> float:
    """The shift Flux's dynamic shifting computes for this size: e**mu (its own
    arithmetic, so the float is the very one)."""
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    config = json.loads((model_dir / "scheduler" / "scheduler_config.json").read_text())
    mu = calculate_shift(
        (width // 16) * (height // 16),
        config["base_image_seq_len"],
        config["max_image_seq_len"],
        config["base_shift"],
        config["max_shift"],
    )
    return math.exp(mu)


# ---------------------------------------------------------------- the cases

Case = Callable[[Route, Path], None]
CASES: dict[str, Case] = {}
EDIT_ONLY: dict[str, Case] = {}


def case(*names: str, edit_only: bool = False) -> Callable[[Case], Case]:
    def register(fn: Case) -> Case:
        for name in names:
            (EDIT_ONLY if edit_only else CASES)[name] = fn
        return fn

    return register


@case("prompt")
def _prompt(r: Route, _: Path) -> None:
    assert r.image() == r.base  # same request, same bytes
    assert r.image(prompt="a blue car") != r.base
    r.refused("prompt", "is required", prompt=None)


@case("negative_prompt")
def _negative_prompt(r: Route, _: Path) -> None:
    guided = r.image(true_cfg_scale=4.0, negative_prompt="blurry")
    assert r.image(true_cfg_scale=4.0, negative_prompt="dark") != guided


@case("true_cfg_scale")
def _true_cfg_scale(r: Route, _: Path) -> None:
    assert r.image(negative_prompt="blurry", true_cfg_scale=4.0) != r.image(
        negative_prompt="blurry"
    )


@case("guidance_scale")
def _guidance_scale(r: Route, _: Path) -> None:
    # The tiny Flux has no guidance embedding (as FLUX.1-schnell): the pipeline takes
    # guidance_scale, and on this model it changes nothing.
    assert r.image(guidance_scale=7.0) == r.base
    r.refused("guidance_scale", "must be between", guidance_scale=-1)


@case("n")
def _n(r: Route, _: Path) -> None:
    two = r.images(n=2)
    assert len(two) == 2 and two[0] != two[1]
    assert all(_decoded(b).size == (64, 64) for b in two)


@case("size")
def _size(r: Route, _: Path) -> None:
    assert _decoded(r.image(size="96x64")).size == (96, 64)
    r.refused("size", "must look like", size="big")


@case("width", "height")
def _width_height(r: Route, _: Path) -> None:
    assert _decoded(r.image(size=None, width=96, height=64)).size == (96, 64)
    assert _decoded(r.image(size=None, width=64, height=96)).size == (64, 96)


@case("num_inference_steps")
def _steps(r: Route, _: Path) -> None:
    assert r.image(num_inference_steps=4) != r.base


@case("seed")
def _seed(r: Route, _: Path) -> None:
    assert r.image(seed=6) != r.base
    answer = r.post(seed=6)
    assert answer.json()["data"][0]["seed"] == 6


@case("output_format")
def _output_format(r: Route, _: Path) -> None:
    for fmt in r.features["output_formats"]:
        answer = r.post(output_format=fmt)
        assert answer.status_code == 200 and answer.json()["output_format"] == fmt, answer.text
        assert base64.b64decode(answer.json()["data"][0]["b64_json"]).startswith(MAGIC[fmt])


@case("output_compression")
def _output_compression(r: Route, _: Path) -> None:
    small = r.image(output_format="jpeg", output_compression=10)
    large = r.image(output_format="jpeg", output_compression=95)
    assert len(small) < len(large)
    r.refused("output_compression", "applies to jpeg and webp only", output_compression=50)


@case("partial_images")
def _partial_images(r: Route, _: Path) -> None:
    events = r.events(partial_images=2)
    kinds = [kind.rsplit(".", 1)[-1] for kind, _ in events]
    assert kinds == ["partial_image", "partial_image", "completed"], kinds
    assert base64.b64decode(events[-1][1]["b64_json"]) == r.base


@case("stream")
def _stream(r: Route, _: Path) -> None:
    events = r.events()
    assert [kind.rsplit(".", 1)[-1] for kind, _ in events] == ["completed"]
    assert base64.b64decode(events[0][1]["b64_json"]) == r.base


@case("response_format")
def _response_format(r: Route, _: Path) -> None:
    offered = r.model["router_features"]["response_formats"]
    for fmt in offered:
        item = r.post(response_format=fmt).json()["data"][0]
        if fmt == "b64_json":
            assert base64.b64decode(item["b64_json"]) == r.base
        else:
            assert r.http.get(item["url"]).content == r.base
    if "url" not in offered:
        r.refused("response_format", "--output-dir", response_format="url")


@case("step_cache")
def _step_cache(r: Route, _: Path) -> None:
    offered = r.features["step_caches"]
    assert set(offered) == {"first_block_cache", "taylorseer"}  # the tiny Flux: both
    assert r.image(step_cache="none") == r.base
    for kind, knob in offered.items():
        named = r.image(step_cache=kind)
        if not r.edit:  # the object form, with the advertised default knob
            assert r.image(step_cache={"type": kind, **knob}) == named, kind
    if not r.edit:
        # Knobs that skip work on random weights: each changes the image.
        skipping = {"type": "first_block_cache", "threshold": 1.0}
        assert r.image(step_cache=skipping) != r.base
        assert r.image(step_cache={"type": "taylorseer", "interval": 2}) != r.base
    assert r.image(step_cache="taylorseer") != r.base
    r.refused("step_cache", "must be", step_cache="teacache")


@case("max_sequence_length")
def _max_sequence_length(r: Route, _: Path) -> None:
    text = r.features["max_sequence_length"]
    if text is None:
        r.refused("max_sequence_length", "is not taken", max_sequence_length=64)
        return
    assert r.image(max_sequence_length=text["max"]) == r.base  # the service's own length
    assert r.image(max_sequence_length=64) != r.base
    r.refused("max_sequence_length", f"at most {text['max']}", max_sequence_length=text["max"] + 1)


@case("flow_shift")
def _flow_shift(r: Route, model_dir: Path) -> None:
    shift = r.features["flow_shift"]
    if shift is None:
        r.refused("flow_shift", "has no shift", flow_shift=3.0)
        return
    same = shift["default"] if shift["default"] is not None else _size_shift(64, 64, model_dir)
    # The shift the scheduler uses anyway: the same schedule, up to float rounding
    # (84 dB here; another shift: below 50).
    assert psnr_db(r.image(flow_shift=same), r.base) > 70
    assert psnr_db(r.image(flow_shift=3.0), r.base) < 60


@case("vae_use_tiling")
def _vae_use_tiling(r: Route, _: Path) -> None:
    if not r.features["vae_tiling"]:
        r.refused("vae_use_tiling", "cannot decode in tiles", vae_use_tiling=True)
        return
    tiled = r.image(vae_use_tiling=True)
    assert _decoded(tiled).size == (64, 64)
    assert tiled != r.base  # the tiny VAE tiles from 32 px: its seams' blending shows
    assert r.image(vae_use_tiling=False) == r.base


@case("vae_use_slicing")
def _vae_use_slicing(r: Route, _: Path) -> None:
    if not r.features["vae_slicing"]:
        r.refused("vae_use_slicing", "cannot decode in slices", vae_use_slicing=True)
        return
    sliced = r.images(n=2, vae_use_slicing=True)
    assert len(sliced) == 2 and all(_decoded(b).size == (64, 64) for b in sliced)
    assert r.image(vae_use_slicing=True) == r.base  # one image: one slice


@case("model")
def _model(r: Route, _: Path) -> None:
    assert r.image(model=r.model["id"]) == r.base


@case("user", "style", "moderation", "safety_identifier", "quality", "background")
def _accepted_openai_fields(r: Route, _: Path) -> None:
    # OpenAI's: the values this server honours change nothing; the others would
    # change the image, so they are refused, never ignored.
    for name, value in (
        ("user", "u-1"),
        ("safety_identifier", "s-1"),
        ("moderation", "auto"),
        ("quality", "auto"),
        ("background", "auto"),
        ("background", "opaque"),
    ):
        assert r.image(**{name: value}) == r.base, name
    r.refused("style", "no styles", style="vivid")
    r.refused("quality", "no quality tiers", quality="hd")
    r.refused("background", "opaque images only", background="transparent")


@case("enable_teacache", "enable_cache_dit")
def _cache_switches(r: Route, _: Path) -> None:
    for name in ("enable_teacache", "enable_cache_dit"):
        assert r.image(**{name: True}) == r.image(step_cache="first_block_cache"), name
        assert r.image(**{name: False}) == r.base, name


@case("output_quality")
def _output_quality(r: Route, _: Path) -> None:
    low = r.image(output_format="jpeg", output_quality="low")
    assert low == r.image(output_format="jpeg", output_compression=35)
    assert r.image(output_quality="high") == r.base  # a PNG has no quality
    r.refused("output_quality", "must be one of", output_quality="best")


@case("generator_device")
def _generator_device(r: Route, _: Path) -> None:
    assert r.image(generator_device="cpu") == r.base
    r.refused("generator_device", "on the CPU", generator_device="cuda")


@case("lora")
def _lora(r: Route, model_dir: Path) -> None:
    from dpserve.worker.tiny_model import build_tiny_lora

    folder = model_dir.parent / "fields-lora"  # under the served --allow-path
    if not folder.is_dir():
        build_tiny_lora(folder, model_dir, seed=3)

    def sent(value: Any) -> Any:  # a form carries the same JSON as text
        return json.dumps(value) if r.edit and not isinstance(value, str) else value

    ink = {"name": "fields-ink", "path": str(folder), "scale": 0.8}
    styled = r.image(lora=sent(ink))
    assert styled != r.base
    assert r.image(lora=sent({"name": "fields-ink", "scale": 0.8})) == styled  # known now
    assert r.image(lora=sent([])) == r.base  # no adapters: the service's own (none)
    assert r.image() == r.base  # nothing stays on
    r.refused("lora", "is not known to this service", lora="nobody")


@case("image", "image[]", edit_only=True)
def _image_upload(r: Route, _: Path) -> None:
    assert r.image(files={"image": ("b.png", OTHER_SOURCE, "image/png")}) != r.base
    assert r.image(files={"image[]": ("in.png", SOURCE, "image/png")}) == r.base


@case("mask", edit_only=True)
def _mask_case(r: Route, _: Path) -> None:
    assert r.features["inpainting"]
    files = {"image": ("in.png", SOURCE, "image/png"), "mask": ("m.png", MASK, "image/png")}
    painted = r.image(files=files)
    assert painted != r.base and _decoded(painted).size == (64, 64)


@case("strength", edit_only=True)
def _strength(r: Route, _: Path) -> None:
    assert r.image(strength=0.9) != r.base
    r.refused("strength", "must be in (0, 1]", strength=2)


@case("input_fidelity", edit_only=True)
def _input_fidelity(r: Route, _: Path) -> None:
    r.refused("input_fidelity", "strength (0-1]", input_fidelity="high")


# ---------------------------------------------------------------- the tests


def _route(serve: ServeProcess, edit: bool) -> Route:
    model = serve.http.get("/v1/models").json()["data"][0]
    return Route(serve.http, edit, model)


def _run_all(route: Route, cases: dict[str, Case], model_dir: Path) -> None:
    """Every advertised field's case; a field without one, or a case without its
    field, fails, and so does each failing case (all of them are named)."""
    advertised = set(route.advertised)
    assert advertised == set(cases), {
        "advertised without a case": sorted(advertised - set(cases)),
        "a case for a field not advertised": sorted(set(cases) - advertised),
    }
    failed: dict[str, str] = {}
    for name in sorted(advertised):
        try:
            cases[name](route, model_dir)
        except AssertionError as exc:
            failed[name] = str(exc)[:300]
    assert not failed, failed


def test_every_advertised_generation_field_works(plain: ServeProcess, tiny_model: Path) -> None:
    _run_all(_route(plain, edit=False), CASES, tiny_model)


def test_every_advertised_edit_field_works(plain: ServeProcess, tiny_model: Path) -> None:
    assert _route(plain, edit=True).features["edits"]
    _run_all(_route(plain, edit=True), {**CASES, **EDIT_ONLY}, tiny_model)


def test_a_requests_step_cache_and_text_length_equal_the_services(
    plain: ServeProcess, tuned: ServeProcess
) -> None:
    mine, service = _route(plain, edit=False), _route(tuned, edit=False)
    assert service.features["step_cache_default"] == {
        "type": "first_block_cache",
        "threshold": TUNED_THRESHOLD,
    }
    assert service.features["max_sequence_length"]["max"] == TUNED_TEXT
    cached = mine.image(
        step_cache={"type": "first_block_cache", "threshold": TUNED_THRESHOLD},
        max_sequence_length=TUNED_TEXT,
    )
    assert cached != mine.base and service.image() == cached
    # "none" turns the service's default off; a request's own cache replaces it.
    short = mine.image(max_sequence_length=TUNED_TEXT)
    assert service.image(step_cache="none") == short != mine.base
    for form in ("taylorseer", {"type": "taylorseer", "interval": 2}):
        asked = {"step_cache": form, "max_sequence_length": TUNED_TEXT}
        assert service.image(step_cache=form) == mine.image(**asked), form
    service.refused("max_sequence_length", f"at most {TUNED_TEXT}", max_sequence_length=256)


def test_every_step_cache_form_through_the_openai_client(plain: ServeProcess) -> None:
    route = _route(plain, edit=False)
    client = openai.OpenAI(base_url=f"{plain.url}/v1", api_key="unused", max_retries=0)
    forms: list[Any] = ["none", {"type": "none"}]
    for kind, knob in route.features["step_caches"].items():
        forms += [kind, {"type": kind, **knob}]
    forms.append({"type": "taylorseer", "interval": 2})
    for form in forms:
        extra = {k: v for k, v in BASE.items() if k not in ("prompt", "size")}
        answer = client.images.generate(
            model=route.model["id"],
            prompt=BASE["prompt"],
            size="64x64",
            extra_body={**extra, "step_cache": form},
        )
        assert answer.data is not None and answer.data[0].b64_json is not None
        got = base64.b64decode(answer.data[0].b64_json)
        assert got == route.image(step_cache=form), form
    with pytest.raises(openai.BadRequestError, match="'unheard-of' is not known"):
        client.images.generate(
            model=route.model["id"],
            prompt="x",
            size="64x64",
            extra_body={"lora": {"name": "unheard-of"}},
        )
