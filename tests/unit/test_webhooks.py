"""Webhook events of video jobs (dpserve/router/webhooks.py, docs/webhooks.md).

The real app over httpx's ASGI transport against stub replicas (tests/stub_replica.py),
posting to a real HTTP receiver on a real socket (``http.server`` in a thread), which
checks every delivery with the official openai client's ``webhooks.verify_signature``.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import zmq.asyncio
from prometheus_client.parser import text_string_to_metric_families

from dpserve.cli import _router_settings, build_parser
from dpserve.contract import video
from dpserve.router import webhooks as wh
from dpserve.router.webhooks import WebhookSettings
from tests.polling import until, until_async
from tests.stub_replica import StubReplica, run_in_context
from tests.unit.test_router_videos import BODY, SLOW, create, routers, stubs, until_status
from tests.webhook_receiver import Delivery, Receiver, receiving

SECRET = "whsec_" + base64.b64encode(bytes(range(32))).decode()
KEY = base64.b64decode(SECRET.removeprefix("whsec_"))
FAILING = "a kite that will not fly"
CLIENT = openai.OpenAI(api_key="unused", base_url="http://127.0.0.1:9")


def _settings(url: str, **kw: Any) -> WebhookSettings:
    return WebhookSettings(url, KEY, **{"first_wait_s": 0.05, **kw})


def _verified(delivery: Delivery) -> dict[str, Any]:
    """The event, once the openai client accepts its signature."""
    CLIENT.webhooks.verify_signature(delivery.body, delivery.headers, secret=SECRET)
    event = CLIENT.webhooks.unwrap(delivery.body, delivery.headers, secret=SECRET)
    body: dict[str, Any] = json.loads(delivery.body)
    assert event.id == body["id"] == delivery.headers["webhook-id"]
    assert event.type == body["type"]
    return body


async def _events(http: httpx.AsyncClient) -> dict[tuple[str, str], float]:
    scrape = (await http.get("/metrics")).text
    return {
        (s.labels["type"], s.labels["outcome"]): s.value
        for family in text_string_to_metric_families(scrape)
        if family.name == "dpserve_webhook_events"
        for s in family.samples
        if s.name.endswith("_total")
    }


async def _counted(http: httpx.AsyncClient, outcome: str, times: float = 1.0) -> bool:
    """Whether exactly ``times`` completed events ended ``outcome``, and none otherwise."""
    return (await _events(http)) == {("video.completed", outcome): times}


def test_completed_and_failed_events_arrive_once_each_signed_for_the_openai_client() -> None:
    async def scenario(ctx: zmq.asyncio.Context) -> None:
        with receiving(Receiver()) as receiver:
            async with (
                stubs(ctx, video_fail_prompts={FAILING}) as replicas,
                routers(replicas, webhook=_settings(receiver.url)) as [(app, http)],
            ):
                done = await create(http)
                failed = await create(http, {**BODY, "prompt": FAILING})
                await until_status(http, done["id"], "completed")
                await until_status(http, failed["id"], "failed")
                seen_done = time.monotonic()
                await until(lambda: len(receiver.got) == 2, 10)
                await until(lambda: app.state.running.videos.watched == 0, 5)
                # A delivery is counted once the receiver's answer is read, which may be
                # after the receiver saw it and the watch ended (seen in CI): wait for it.
                both = {("video.completed", "delivered"): 1.0, ("video.failed", "delivered"): 1.0}

                async def counted() -> bool:
                    return await _events(http) == both

                await until_async(counted, 5)
                assert len(receiver.got) == 2  # once each: the watches are over
                lag = max(d.at for d in receiver.got) - seen_done
                print(f"last event {lag * 1000:.0f} ms after the client saw the job finish")
        by_type = {(b := _verified(d))["type"]: (b, d) for d in receiver.got}
        for job, kind in ((done, "video.completed"), (failed, "video.failed")):
            body, delivery = by_type[kind]
            assert body["object"] == "event" and body["data"] == {"id": job["id"]}
            assert isinstance(body["created_at"], int)
            assert body["id"] == wh.event_id(job["id"], kind)
            assert delivery.headers["webhook-signature"].startswith("v1,")
            assert abs(int(delivery.headers["webhook-timestamp"]) - time.time()) < 60
        tampered = by_type["video.completed"][1]
        with pytest.raises(openai.InvalidWebhookSignatureError):
            CLIENT.webhooks.verify_signature(
                tampered.body.replace(b"completed", b"failed"), tampered.headers, secret=SECRET
            )

    run_in_context(scenario)


def test_a_receiver_that_fails_twice_gets_the_event_on_the_third_try_under_one_id() -> None:
    async def scenario(ctx: zmq.asyncio.Context) -> None:
        with receiving(Receiver(answers=[500, 503])) as receiver:
            async with (
                stubs(ctx) as replicas,
                routers(replicas, webhook=_settings(receiver.url)) as [(_, http)],
            ):
                job = await create(http)
                await until_status(http, job["id"], "completed")
                await until(lambda: len(receiver.got) == 3, 10)
                await until_async(lambda: _counted(http, "delivered"), 5)
        ids = {d.headers["webhook-id"] for d in receiver.got}
        assert ids == {wh.event_id(job["id"], "video.completed")}
        bodies = {d.body for d in receiver.got}
        assert len(bodies) == 1  # the same event, signed afresh each try
        for delivery in receiver.got:
            _verified(delivery)
        waits = [b.at - a.at for a, b in zip(receiver.got, receiver.got[1:], strict=False)]
        assert waits[1] > waits[0] * 1.5  # the wait doubles

    run_in_context(scenario)


def test_a_job_given_up_after_its_third_lost_attempt_sends_video_failed() -> None:
    async def scenario(ctx: zmq.asyncio.Context) -> None:
        with receiving(Receiver()) as receiver:
            async with (
                stubs(ctx) as [stub],
                routers([stub], webhook=_settings(receiver.url)) as [(_, http)],
            ):
                job = await create(http, SLOW)
                for attempt in (1, 2, 3):
                    await until(lambda: _attempt(stub, job["id"]) == attempt, 10)  # noqa: B023
                    stub.reboot()
                await until(lambda: len(receiver.got) == 1, 10)
        body = _verified(receiver.got[0])
        assert body["type"] == "video.failed" and body["data"] == {"id": job["id"]}

    run_in_context(scenario)


def _attempt(stub: StubReplica, job_id: str) -> int:
    job = stub.job(job_id)
    return 0 if job is None else job.attempt


def test_two_routers_that_send_the_same_event_send_the_same_id_and_body() -> None:
    """However many routers see a job end (or one sees it twice), a receiver gets one
    id and one body: it drops the repeats by ``webhook-id``."""
    job = video.VideoJob(
        id="video_abc", status=video.COMPLETED, created_at=1, completed_at=1764860000,
        width=64, height=64, num_frames=9, fps=8, seconds=1.1, seed=1,
    )  # fmt: skip

    async def scenario() -> None:
        senders = [wh.Webhooks(_settings(receiver.url), lambda *_: None) for _ in range(2)]
        for sender in senders:
            sender.start()
            sender.emit(job)
        try:
            await until(lambda: len(receiver.got) == 2, 5)
        finally:
            for sender in senders:
                await sender.close()

    with receiving(Receiver()) as receiver:
        asyncio.run(scenario())
    first, second = receiver.got
    assert first.headers["webhook-id"] == second.headers["webhook-id"]
    assert first.body == second.body
    assert _verified(first)["created_at"] == 1764860000


def _gauge(scrape: str) -> float:
    (value,) = [
        s.value
        for family in text_string_to_metric_families(scrape)
        if family.name == "dpserve_webhook_events_waiting"
        for s in family.samples
    ]
    return value


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def test_a_dead_receiver_delays_no_job_and_no_request_and_is_given_up() -> None:
    async def scenario(ctx: zmq.asyncio.Context) -> None:
        dead = f"http://127.0.0.1:{_closed_port()}/hooks"
        settings = _settings(dead, retry_for_s=0.5)
        async with stubs(ctx) as replicas, routers(replicas, webhook=settings) as [(_, http)]:
            started = time.monotonic()
            jobs = [await create(http) for _ in range(3)]
            for job in jobs:
                await until_status(http, job["id"], "completed")
            took = time.monotonic() - started
            # 3 jobs of 2 steps of 20 ms, one at a time, and 50 ms polls: well under a second.
            assert took < 3, took
            asked = time.monotonic()
            assert (await http.get("/v1/models")).status_code == 200
            assert time.monotonic() - asked < 0.5

            await until_async(lambda: _counted(http, "given_up", 3.0), 10)

    run_in_context(scenario)


def test_a_slow_receiver_delays_nothing_and_events_past_the_queue_are_dropped_and_counted() -> None:
    async def scenario(ctx: zmq.asyncio.Context) -> None:
        with receiving(Receiver(hold=threading.Event())) as receiver:
            settings = _settings(receiver.url, senders=1, queue=1, attempt_timeout_s=30)
            async with stubs(ctx) as replicas, routers(replicas, webhook=settings) as [(_, http)]:
                started = time.monotonic()
                jobs = [await create(http) for _ in range(3)]
                for job in jobs:
                    await until_status(http, job["id"], "completed")
                assert time.monotonic() - started < 3
                asked = time.monotonic()
                assert (await http.get("/v1/models")).status_code == 200
                assert time.monotonic() - asked < 0.5
                # One event is held by the receiver, one waits in the queue, one is dropped.
                await until_async(lambda: _counted(http, "dropped"), 5)
                assert len(receiver.got) == 1  # held: the one sender waits for its answer
                assert _gauge((await http.get("/metrics")).text) == 1.0  # the one queued
                assert receiver.hold is not None
                receiver.hold.set()
                await until(lambda: len(receiver.got) == 2, 5)

    run_in_context(scenario)


# ---------------------------------------------------------------- configuration


def _secret_file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "secret"
    path.write_text(text)
    return str(path)


def test_the_flags_reach_the_settings_on_router_and_serve(tmp_path: Path) -> None:
    secret = _secret_file(tmp_path, SECRET + "\n")
    url = "https://hooks.example.com/dpserve?team=a"
    argv = ["--webhook-url", url, "--webhook-secret-file", secret, "--webhook-retry-for", "90"]
    router = build_parser().parse_args(["router", "--worker", "tcp://x:1", *argv])
    settings = _router_settings(router, router.worker)
    assert settings.webhook == WebhookSettings(url, KEY, retry_for_s=90)
    assert SECRET not in repr(settings) and repr(KEY) not in repr(settings)
    serve = build_parser().parse_args(["serve", *argv])
    assert _router_settings(serve, []).webhook == settings.webhook
    plain = build_parser().parse_args(["router", "--worker", "tcp://x:1"])
    assert _router_settings(plain, plain.worker).webhook is None


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("sk-not-a-webhook-secret", "does not hold a Standard Webhooks secret"),
        ("whsec_not base64!", "not valid base64"),
        ("whsec_" + base64.b64encode(b"short").decode(), "is 5 bytes"),
    ],
)
def test_a_bad_secret_file_fails_the_start(
    tmp_path: Path, text: str, why: str, capsys: pytest.CaptureFixture[str]
) -> None:
    secret = _secret_file(tmp_path, text)
    argv = ["router", "--worker", "tcp://x:1", "--webhook-secret-file", secret]
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert why in err and "--webhook-secret-file" in err
    assert "sk-not" not in err  # the message never shows the secret


def test_a_bad_url_or_half_the_pair_fails_the_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for url, why in (
        ("ftp://example.com/x", "is not http(s)://HOST"),
        ("https:///nohost", "is not http(s)://HOST"),
        ("https://user:pw@example.com/x", "carries credentials"),
        ("http://example.com:99999/x", "is not a URL"),
    ):
        with pytest.raises(SystemExit) as exited:
            build_parser().parse_args(["router", "--worker", "tcp://x:1", "--webhook-url", url])
        assert exited.value.code == 2
        assert why in capsys.readouterr().err
    secret = _secret_file(tmp_path, SECRET)
    for half in (["--webhook-url", "https://example.com/h"], ["--webhook-secret-file", secret]):
        args = build_parser().parse_args(["router", "--worker", "tcp://x:1", *half])
        with pytest.raises(SystemExit) as exited:
            _router_settings(args, args.worker)
        assert exited.value.code == 2
        assert "needs --webhook-" in capsys.readouterr().err


def test_signatures_follow_standard_webhooks() -> None:
    """A fresh secret of the documented recipe, signed here, verified by openai."""
    secret = "whsec_" + base64.b64encode(os.urandom(32)).decode()
    key = base64.b64decode(secret[6:])
    body = b'{"id":"evt_1","object":"event","type":"video.completed"}'
    now = int(time.time())
    headers = {
        "webhook-id": "evt_1",
        "webhook-timestamp": str(now),
        "webhook-signature": wh.sign(key, "evt_1", now, body),
    }
    CLIENT.webhooks.verify_signature(body, headers, secret=secret)
    assert wh.event_id("video_a", "video.completed") == wh.event_id("video_a", "video.completed")
    assert wh.event_id("video_a", "video.completed") != wh.event_id("video_a", "video.failed")
