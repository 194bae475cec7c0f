"""DNS rebinding (dpserve/router/hosts.py): a request whose Host is not a name the
router is known by is refused (421), keys or not, WebSocket upgrades too."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import httpx
import pytest
from starlette.testclient import TestClient, WebSocketDenialResponse

from dpserve.cli import _router_settings, build_parser
from dpserve.operator import builders as b
from dpserve.operator.spec import DiffusionServiceSpec
from dpserve.router.app import RouterSettings, create_app
from dpserve.router.hosts import AllowedHosts


def test_loopback_names_ip_literals_and_given_names_are_allowed() -> None:
    hosts = AllowedHosts.of(["Images.Example.COM.", "svc.ns"], "http://127.0.0.1:8000")
    for host in (
        "localhost",
        "localhost:8000",
        "LOCALHOST.",
        "app.localhost:3000",  # browsers resolve *.localhost to loopback themselves
        "127.0.0.1:8000",
        "127.5.6.7",
        "[::1]:8000",
        "10.2.3.4:8000",  # a pod IP: an IP literal cannot be rebound
        "[fe80::1%eth0]",
        "images.example.com:443",
        "svc.ns",
        None,  # HTTP/1.0, no browser
    ):
        assert hosts.allows(host), host
    for host in (
        "evil.example",
        "evil.example:8000",
        "localhost.evil.example",
        "127.0.0.1.nip.io",
        "svc",
        "",
        "[::1",
    ):
        assert not hosts.allows(host), host


def test_the_public_url_s_host_and_a_star() -> None:
    assert AllowedHosts.of([], "https://user@gen.example.org:8443/base").allows("gen.example.org")
    assert AllowedHosts.of(["*"]).allows("anything.at.all")
    assert not AllowedHosts.of([], "http://0.0.0.0:8000").allows("box.lan")


def _run(scenario: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(scenario())


def test_a_rebound_page_is_refused_on_every_route_keys_or_not() -> None:
    """Before: with no keys a page rebound to 127.0.0.1 released memory, read
    /server_info and opened the WebSocket."""

    async def scenario() -> None:
        for keys in ({}, {"admin_keys": ("sk-admin",)}):
            app = create_app(RouterSettings(**keys))
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(
                transport=transport, base_url="http://evil.example"
            ) as http:
                auth = {"authorization": "Bearer sk-admin"}
                for method, path in (
                    ("POST", "/release_memory_occupation"),
                    ("GET", "/server_info"),
                    ("GET", "/v1/models"),
                    ("GET", "/health"),
                ):
                    refused = await http.request(method, path, headers=auth)
                    assert refused.status_code == 421, (keys, path)
                    error = refused.json()["error"]
                    assert error["code"] == "misdirected_request"
                    assert (
                        "--allowed-host" in error["message"] and "evil.example" in error["message"]
                    )
                    assert refused.headers["x-request-id"] == refused.json()["id"]
                served = await http.get("/livez", headers={"host": "127.0.0.1:8000"})
                assert served.status_code == 200

    _run(scenario)


def test_a_rebound_page_s_websocket_is_refused_before_it_is_accepted() -> None:
    app = create_app(RouterSettings())
    with TestClient(app, base_url="http://evil.example") as client:
        with (
            pytest.raises(WebSocketDenialResponse) as caught,
            client.websocket_connect("ws://evil.example/v1/realtime_video/generate"),
        ):
            pass
        assert caught.value.status_code == 421
        assert "--allowed-host" in caught.value.json()["error"]["message"]


def test_allowed_host_is_a_flag_of_router_and_serve() -> None:
    async def served(settings: RouterSettings, host: str) -> int:
        transport = httpx.ASGITransport(app=create_app(settings))
        async with httpx.AsyncClient(transport=transport, base_url=f"http://{host}") as http:
            return (await http.get("/livez")).status_code

    for command in (["router", "--worker", "tcp://x:1"], ["serve"]):
        flags = ["--allowed-host", "gen.example.org", "--allowed-host", "box.lan"]
        settings = _router_settings(build_parser().parse_args([*command, *flags]), ())
        assert settings.allowed_hosts == ("gen.example.org", "box.lan")
        assert asyncio.run(served(settings, "box.lan")) == 200
        assert asyncio.run(served(settings, "evil.example")) == 421
        anyone = _router_settings(build_parser().parse_args([*command, "--allowed-host", "*"]), ())
        assert asyncio.run(served(anyone, "evil.example")) == 200
        public = ["--public-url", "https://gen.example.org"]
        by_url = _router_settings(build_parser().parse_args([*command, *public]), ())
        assert asyncio.run(served(by_url, "gen.example.org")) == 200


def test_the_operator_lets_the_router_answer_its_service_names() -> None:
    spec = DiffusionServiceSpec.model_validate(
        {"model": {"path": "/models/m"}, "router": {"allowedHosts": ["images.example.com"]}}
    )
    args = b.router_args(b.Svc("qwen", "ml", "uid-1", 1, spec))
    parsed = build_parser().parse_args(args)
    assert parsed.allowed_host == (
        "qwen",
        "qwen.ml",
        "qwen.ml.svc",
        "qwen.ml.svc.cluster.local",
        "images.example.com",
    )
    with pytest.raises(ValueError, match="allowedHosts"):
        DiffusionServiceSpec.model_validate(
            {"model": {"path": "/m"}, "router": {"allowedHosts": ["evil.example:80/x"]}}
        )
