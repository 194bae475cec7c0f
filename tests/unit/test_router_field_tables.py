"""The request fields' tables hold where a client meets them: each body route's schema in
/openapi.json names the fields its parser knows and the router's own, every field it
names is taken (never "is not a known field") while an undeclared one is refused,
the parser refuses what lies past the bounds the schema gives, and /v1/models'
``request_fields`` lists the same fields (dpserve/router/fields.py).

The real app over httpx's ASGI transport against the stub replica (tests/stub_replica.py),
which parses what arrives as a driver does.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from dpserve.contract import validation as pv
from dpserve.contract import video
from dpserve.router import fields
from dpserve.router.app import RouterSettings, create_app
from tests.stub_replica import run_in_context
from tests.unit.test_router_images import BODY, EDITS, GEN, PNG, _router, _run
from tests.unit.test_router_videos import BODY as VIDEO_BODY
from tests.unit.test_router_videos import routers, stubs

VARIATIONS, VIDEOS = "/v1/images/variations", "/v1/videos"
JSON, FORM = "application/json", "multipart/form-data"
# Each body route: where it is, the body's media type, and its row set's name.
ROUTES = {
    fields.GENERATIONS: (GEN, JSON),
    fields.EDITS: (EDITS, FORM),
    fields.VARIATIONS: (VARIATIONS, FORM),
    fields.VIDEOS: (VIDEOS, JSON),
    fields.VIDEO_FORM: (VIDEOS, FORM),
}
UNKNOWN = "not_a_field"


async def _schemas(http: httpx.AsyncClient) -> dict[str, dict[str, Any]]:
    """Each body route's request schema, as /openapi.json serves it."""
    paths = (await http.get("/openapi.json")).json()["paths"]
    return {
        route: paths[path]["post"]["requestBody"]["content"][media]["schema"]
        for route, (path, media) in ROUTES.items()
    }


def _unknown(answer: httpx.Response) -> list[str]:
    """The fields a 400 calls unknown."""
    assert answer.status_code == 400, answer.text
    named = answer.json()["error"]["fields"]
    return [f["field"] for f in named if f["message"] == "is not a known field"]


def _uploads(schema: dict[str, Any]) -> set[str]:
    """A form's file fields."""
    return {k for k, v in schema["properties"].items() if '"binary"' in json.dumps(v)}


def _as_text(prop: dict[str, Any], served: str) -> str:
    """A form value of the type a property declares (any value: only its name is tested)."""
    if prop.get("title") == "Model":
        return served
    if prop.get("default") is not None:
        return json.dumps(prop["default"]).strip('"')
    kinds = [prop, *prop.get("anyOf", [])]
    types = {k.get("type") for k in kinds}
    if "boolean" in types:
        return "false"
    if types & {"integer", "number"}:
        return f"{next((k['minimum'] for k in kinds if 'minimum' in k), 1):g}"
    return "x"


def test_each_schema_declares_the_parsers_fields_and_the_routers_own() -> None:
    async def scenario() -> None:
        async with _router() as (http, _):
            schemas = await _schemas(http)
            advertised = (await http.get("/v1/models")).json()["data"][0]["router_features"]
        for route, schema in schemas.items():
            declared = set(schema["properties"])
            assert declared == fields.names(fields.route_fields(route)), route
            parsed = video.VIDEO_FIELDS if route in (fields.VIDEOS, fields.VIDEO_FORM) else None
            assert (parsed or pv.GENERATE_FIELDS) <= declared, route
            assert schema["additionalProperties"] is False, route
        # Variations take the edit form's fields (refusing some of them by name).
        assert set(schemas[fields.VARIATIONS]["properties"]) == set(
            schemas[fields.EDITS]["properties"]
        )
        assert set(schemas[fields.VIDEOS]["properties"]) == set(
            schemas[fields.VIDEO_FORM]["properties"]
        )
        for route in fields.ADVERTISED:
            assert advertised["request_fields"][route] == sorted(schemas[route]["properties"])

    _run(scenario)


def test_every_declared_image_field_is_taken_and_an_undeclared_one_is_refused() -> None:
    async def scenario() -> None:
        async with _router() as (http, stub):
            schemas = await _schemas(http)
            served = (await http.get("/v1/models")).json()["data"][0]["id"]
            # JSON: every declared field at its declared default (null: left out).
            props = schemas[fields.GENERATIONS]["properties"]
            body = {name: prop.get("default") for name, prop in props.items()}
            body["prompt"] = "x"
            assert _unknown(await http.post(GEN, json={**body, UNKNOWN: 1})) == [UNKNOWN]
            taken = await http.post(GEN, json=body)
            assert taken.status_code == 200, taken.text
            # The edit form: every declared text field, and an image file.
            schema = schemas[fields.EDITS]
            form = {
                name: _as_text(prop, served)
                for name, prop in schema["properties"].items()
                if name not in _uploads(schema)
            }
            files = {"image": ("a.png", PNG, "image/png")}
            answer = await http.post(EDITS, data={**form, UNKNOWN: "1"}, files=files)
            assert _unknown(answer) == [UNKNOWN]
            assert len(stub.received) == 1

    _run(scenario)


def test_every_declared_video_field_is_taken_and_an_undeclared_one_is_refused() -> None:
    async def scenario(ctx: Any) -> None:
        async with stubs(ctx) as replicas, routers(replicas) as [(_, http)]:
            schemas = await _schemas(http)
            served = (await http.get("/v1/models")).json()["data"][0]["id"]
            body: dict[str, Any] = dict.fromkeys(schemas[fields.VIDEOS]["properties"])
            body["prompt"] = "x"
            assert _unknown(await http.post(VIDEOS, json={**body, UNKNOWN: 1})) == [UNKNOWN]
            schema = schemas[fields.VIDEO_FORM]
            form = {
                name: _as_text(prop, served)
                for name, prop in schema["properties"].items()
                if name not in _uploads(schema)
            }
            # Text parts of a multipart body: (no file name, the text).
            parts = {name: (None, text) for name, text in {**form, UNKNOWN: "1"}.items()}
            assert _unknown(await http.post(VIDEOS, files=parts)) == [UNKNOWN]

    run_in_context(scenario)


def _past_bounds(prop: dict[str, Any]) -> list[Any]:
    """Values just past each bound a property declares."""
    kinds = [prop, *prop.get("anyOf", [])]
    out: list[Any] = []
    for kind in kinds:
        if "maxLength" in kind:
            out.append("x" * (kind["maxLength"] + 1))
        for low in ("minimum", "ge"):
            if low in kind:
                out.append(int(kind[low]) - 1)
        for high in ("maximum", "le"):
            if high in kind:
                out.append(int(kind[high]) + 1)
    return out


def _bound_cases(path: str) -> list[tuple[str, Any]]:
    """Each field of the route's JSON body with a value just past a bound it declares."""
    schema = create_app(RouterSettings()).openapi()["paths"][path]["post"]["requestBody"]
    props = schema["content"][JSON]["schema"]["properties"]
    return [(name, value) for name, prop in props.items() for value in _past_bounds(prop)]


async def _refused_one_by_one(
    http: httpx.AsyncClient, path: str, body: dict[str, Any], cases: list[tuple[str, Any]]
) -> None:
    for name, value in cases:
        answer = await http.post(path, json={**body, name: value})
        assert answer.status_code == 400, (name, value, answer.text)
        named = [f["field"] for f in answer.json()["error"]["fields"]]
        assert named == [name], (name, value, named)


def test_the_parser_refuses_what_lies_past_the_declared_bounds() -> None:
    cases = _bound_cases(GEN)
    assert {"n", "seed", "num_inference_steps", "flow_shift", "prompt"} <= {n for n, _ in cases}

    async def scenario() -> None:
        async with _router() as (http, stub):
            await _refused_one_by_one(http, GEN, BODY, cases)
            assert stub.received == []

    _run(scenario)


def test_the_video_parser_refuses_what_lies_past_the_declared_bounds() -> None:
    cases = _bound_cases(VIDEOS)
    assert {"fps", "num_frames", "seed", "guidance_scale", "prompt"} <= {n for n, _ in cases}

    async def scenario(ctx: Any) -> None:
        async with stubs(ctx) as [stub], routers([stub]) as [(_, http)]:
            await _refused_one_by_one(http, VIDEOS, VIDEO_BODY, cases)
            assert stub.video_submits == []

    run_in_context(scenario)


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_the_router_only_fields_are_the_routes_fields_the_parser_does_not_know(
    route: str,
) -> None:
    parsed = fields.names(fields.parsed(route))
    taken = fields.names(fields.route_fields(route))
    assert fields.router_only(route) == taken - parsed
    assert not fields.router_only(route) & parsed
