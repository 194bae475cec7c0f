"""``--output-store s3://…``: url images go to a real S3 server and come back as
presigned links (dpserve/router/bucket.py, docs/outputs.md).

Routers run in process over a stub replica on the real wire; the store is the real
server of tests/storage/s3.py, reached the way users configure it (the ``AWS_*``
variables), and every link is fetched over plain HTTP with no key.
"""

from __future__ import annotations

import asyncio
import base64
import io
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import zmq.asyncio
from PIL import Image

from dpserve.plumbing.ports import free_port
from dpserve.router.tenants import TenantKey
from dpserve.sources.uri import S3Source
from tests.polling import eventually
from tests.servers import ServeProcess
from tests.storage.s3 import S3Server
from tests.stub_replica import StubReplica
from tests.unit.test_router_images import BODY, GEN, _apps

pytestmark = [pytest.mark.e2e, pytest.mark.s3]
T = TypeVar("T")
KEY = "sk-team-a-one"
KEYS: dict[str, Any] = {"api_keys": (TenantKey(KEY, "team-a"),)}
AUTH = {"Authorization": f"Bearer {KEY}"}


def _with_stub(scenario: Callable[[StubReplica], Coroutine[Any, Any, T]]) -> T:
    async def run() -> T:
        ctx = zmq.asyncio.Context()
        stub = StubReplica(ctx)
        try:
            return await scenario(stub)
        finally:
            await stub.close()
            ctx.term()

    return asyncio.run(run())


def _get(url: str) -> httpx.Response:
    """The link as a browser opens it: plain HTTP, no key, no SDK."""
    return httpx.get(url, timeout=10)


def test_a_url_answer_is_uploaded_and_its_link_downloads_the_same_png_without_a_key(
    s3_server: S3Server, aws_env: dict[str, str]
) -> None:
    bucket = s3_server.new_bucket("outputs")
    store = S3Source(bucket, "fleet/")

    async def scenario(stub: StubReplica) -> tuple[str, bytes]:
        async with _apps(stub, output_s3=store, **KEYS) as [(_, http)]:
            made = await http.post(GEN, json={**BODY, "response_format": "url"}, headers=AUTH)
            inline = await http.post(GEN, json=BODY, headers=AUTH)
        assert made.status_code == 200 and inline.status_code == 200, (made.text, inline.text)
        return made.json()["data"][0]["url"], base64.b64decode(inline.json()["data"][0]["b64_json"])

    url, png = _with_stub(scenario)
    # The router that made it is gone: the link goes to the store, not to a router.
    got = _get(url)
    assert got.status_code == 200, got.text
    assert got.content == png and png.startswith(b"\x89PNG")
    assert got.headers["content-type"] == "image/png"
    # In the bucket under the prefix, the tenant in its name and its metadata.
    listed = s3_server.client().list_objects_v2(Bucket=bucket)["Contents"]
    [key] = [o["Key"] for o in listed]
    assert key.startswith("fleet/images/") and key.endswith(".team-a.png")
    head = s3_server.client().head_object(Bucket=bucket, Key=key)
    assert head["Metadata"] == {"tenant": "team-a"}
    assert "X-Amz-Signature=" in url and "X-Amz-Expires=3600" in url


def test_an_image_made_through_one_router_downloads_while_another_serves(
    s3_server: S3Server, aws_env: dict[str, str]
) -> None:
    """Two router pods sharing the store: links made by either download alike, and
    the store is the only thing they share (no folder, no volume)."""
    store = S3Source(s3_server.new_bucket("outputs"), "")

    async def scenario(stub: StubReplica) -> list[str]:
        async with _apps(stub, count=2, output_s3=store) as routers:
            answers = [
                await http.post(GEN, json={**BODY, "response_format": "url", "n": 2})
                for _, http in routers
            ]
        return [d["url"] for a in answers for d in a.json()["data"]]

    urls = _with_stub(scenario)
    assert len(set(urls)) == 4
    assert all(_get(u).status_code == 200 for u in urls)


def test_a_link_expires_when_it_says(s3_server: S3Server, aws_env: dict[str, str]) -> None:
    store = S3Source(s3_server.new_bucket("outputs"), "short/")

    async def scenario(stub: StubReplica) -> str:
        async with _apps(stub, output_s3=store, output_url_ttl_s=2) as [(_, http)]:
            made = await http.post(GEN, json={**BODY, "response_format": "url"})
        return str(made.json()["data"][0]["url"])

    made_at = time.monotonic()
    url = _with_stub(scenario)
    assert "X-Amz-Expires=2" in url
    assert _get(url).status_code == 200  # good at once
    gone = eventually(lambda: _get(url).status_code == 403, 15, "the link to expire", 0.2)
    assert gone and time.monotonic() - made_at >= 1  # not before its second is out
    assert b"xpired" in _get(url).content  # the store says why


def test_a_store_that_is_down_is_a_503_that_says_so_in_seconds(
    s3_server: S3Server, aws_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port('127.0.0.1')}")
    store = S3Source("outputs", "")

    async def scenario(stub: StubReplica) -> tuple[httpx.Response, float]:
        async with _apps(stub, output_s3=store) as [(_, http)]:
            start = time.monotonic()
            made = await http.post(GEN, json={**BODY, "response_format": "url"})
            return made, time.monotonic() - start

    made, took = _with_stub(scenario)
    assert made.status_code == 503, made.text
    message = made.json()["error"]["message"]
    assert "could not be stored" in message and "s3://outputs/" in message
    assert "did not answer" in message and "b64_json" in message
    assert took < 20  # a clear refusal, not a hang


def test_serve_with_an_output_store_answers_links_to_a_real_models_images(
    s3_server: S3Server, aws_env: dict[str, str], tiny_model: Path
) -> None:
    """The way a user reaches it: ``dpserve serve --output-store s3://…`` configured by
    the AWS_* variables alone, a real model behind it."""
    bucket = s3_server.new_bucket("outputs")
    store = ("--output-store", f"s3://{bucket}/serve", "--output-url-ttl", "30")
    with ServeProcess(tiny_model, 1, *store) as serve:
        features = serve.http.get("/v1/models").json()["data"][0]["router_features"]
        assert features["response_formats"] == ["b64_json", "url"]
        made = serve.http.post(
            GEN, json={**BODY, "num_inference_steps": 2, "response_format": "url"}
        )
        assert made.status_code == 200, made.text
        url = made.json()["data"][0]["url"]
    assert "X-Amz-Expires=30" in url and f"/{bucket}/serve/images/" in url
    got = _get(url)  # serve is gone: the store answers
    assert got.status_code == 200, got.text
    with Image.open(io.BytesIO(got.content)) as image:
        assert (image.format, image.size) == ("PNG", (64, 64))
