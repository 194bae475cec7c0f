"""The Kubernetes journey of outputs (docs/outputs.md, docs/webhooks.md), on a real node.

A real S3 server listens on the node's bridge gateway (the host as pods see it), and
so does a webhook receiver; the store's ``AWS_*`` variables and the webhook's signing
secret are Secrets the DiffusionServices name (``spec.router.outputStore``,
``spec.router.webhook``). Each service has two router pods. Every step is asserted
through what a user sees: the router Service and pod addresses, links, downloads,
kubectl, and the events the receiver got:

1. an image answered as a link (``response_format=url``) through one router pod
   downloads as the PNG the other router pod answers inline for the same seed, also
   after the first router pod is deleted;
2. a video job whose router pods and then owner replica pod are deleted while it
   runs completes, re-run (attempt 2) by a router that was not there when it was
   placed and took it over from its record in the store; it downloads through the
   replaced router pods, after every pod involved is replaced, and after a
   scale-down to one replica;
3. the receiver got one event id for that job, ``video.completed``, which the official
   openai client verifies.

A video model makes no images, so the image step has its own service (the tiny image
model, one replica); both are applied at once and start side by side.

Only ``--cluster node``: pods of the test kubelet or kind reach neither the gateway
nor the host's servers on it.
"""

from __future__ import annotations

import base64
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.backends import NodeBackend
from tests.e2e.operator_install import operator_installed
from tests.polling import eventually
from tests.storage.s3 import S3Server, build_server, running_s3
from tests.webhook_receiver import Receiver, receiving

# As the other journeys: the images build and reach the node first (minutes when cold).
pytestmark = [pytest.mark.e2e, pytest.mark.cluster, pytest.mark.s3, pytest.mark.timeout(2400)]
NS = "outputs"
VIDEO, IMAGE = "vid", "img"
STORE_SECRET, HOOK_SECRET = "output-store", "output-webhook"
# Both services share one folder of the bucket: each router takes over its own
# service's jobs only (a job record names its service), so the image service's routers
# never take the video job over while the video routers are gone.
PREFIX = {VIDEO: "fleet/", IMAGE: "fleet/"}
ROUTER_PORT = 8000  # the router container's (dpserve/operator/builders.py)
WHSEC = "whsec_" + base64.b64encode(os.urandom(32)).decode()
REQUEST = {"prompt": "a red kite", "size": "64x64", "num_inference_steps": 2, "seed": 9}
# Long enough that a router pod is replaced while it runs (about 15 s of steps and 17
# of decoding and encoding on one thread; more under load), short enough that its
# re-run is quick.
JOB = {"prompt": "a kite in the wind", "size": "192x144", "num_frames": 113, "seed": 5,
       "num_inference_steps": 100}  # fmt: skip
FORCE = ("--grace-period=0", "--force", "--wait=false")


@dataclass(frozen=True)
class Store:
    server: S3Server
    bucket: str

    def keys(self, under: str) -> list[str]:
        listed = self.server.client().list_objects_v2(Bucket=self.bucket, Prefix=under)
        return sorted(o["Key"] for o in listed.get("Contents", []))

    def read(self, key: str) -> bytes:
        body = self.server.client().get_object(Bucket=self.bucket, Key=key)["Body"]
        return bytes(body.read())


@dataclass
class Seen:
    """What the video step leaves for the webhook step, and the figures printed last."""

    job_id: str = ""
    completed_at: float = 0.0  # monotonic: when a router first said completed
    figures: list[str] = field(default_factory=list)


# ------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def node(request: pytest.FixtureRequest) -> NodeBackend:
    if request.config.getoption("--cluster") != "node":
        pytest.skip("the outputs journey needs --cluster node (servers on the gateway)")
    backend = request.getfixturevalue("backend")
    assert isinstance(backend, NodeBackend)
    return backend


@pytest.fixture(scope="module")
def store(node: NodeBackend) -> Iterator[Store]:
    with running_s3(build_server(), host=node.cluster.network.gateway) as server:
        yield Store(server, server.new_bucket("outputs"))


@pytest.fixture(scope="module")
def receiver(node: NodeBackend) -> Iterator[Receiver]:
    with receiving(Receiver(), host=node.cluster.network.gateway) as got:
        yield got


@pytest.fixture(scope="module")
def k8s(node: NodeBackend, store: Store, receiver: Receiver) -> Iterator[NodeBackend]:
    """The operator, the two Secrets, and both services Ready (deleted on leaving)."""
    with operator_installed(node, NS):
        secrets = {STORE_SECRET: store.server.env(), HOOK_SECRET: {"webhook-secret": WHSEC}}
        for name, data in secrets.items():
            secret = {"apiVersion": "v1", "kind": "Secret",
                      "metadata": {"name": name, "namespace": NS}, "stringData": data}  # fmt: skip
            node.kubectl("apply", "-f", "-", input=json.dumps(secret))
        for name, model, replicas in ((VIDEO, "/models/tiny-video", 2), (IMAGE, "/models/tiny", 1)):
            body = service(name, model, replicas, store, receiver.url)
            node.kubectl("apply", "-f", "-", input=json.dumps(body))
        try:
            for name in (VIDEO, IMAGE):
                node.kubectl("-n", NS, "wait", "--for=condition=Ready", f"dsvc/{name}",
                             "--timeout=300s")  # fmt: skip
            yield node
        finally:
            for name in (VIDEO, IMAGE):
                node.kubectl("-n", NS, "delete", "dsvc", name, "--ignore-not-found",
                             "--timeout=120s", check=False)  # fmt: skip


@pytest.fixture(scope="module")
def seen() -> Seen:
    return Seen()


@pytest.fixture(autouse=True)
def logs_on_failure(request: pytest.FixtureRequest) -> Iterator[None]:
    """A failed step shows what the pods said (a deleted pod's logs are gone with it)."""
    failed = request.session.testsfailed
    yield
    if request.session.testsfailed == failed or "node" not in request.fixturenames:
        return
    node: NodeBackend = request.getfixturevalue("node")
    for component in ("router", "replica"):
        got = node.kubectl("-n", NS, "logs", "-l", f"app.kubernetes.io/component={component}",
                           "--prefix", "--tail=60", check=False)  # fmt: skip
        print(f"--- {component} pods' logs:\n{got.stdout}{got.stderr}")


def service(name: str, model: str, replicas: int, store: Store, hook: str) -> dict[str, Any]:
    return {
        "apiVersion": "dpserve.dev/v1alpha1",
        "kind": "DiffusionService",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "model": {"path": model}, "device": "cpu", "replicas": replicas,
            "threadsPerRank": 1, "maxSequenceLength": 77,
            "resources": {"requests": {"cpu": "250m", "memory": "512Mi"},
                          "limits": {"memory": "2Gi"}},
            "router": {
                "replicas": 2,
                "outputStore": {"uri": f"s3://{store.bucket}/{PREFIX[name]}",
                                "credentials": {"secretName": STORE_SECRET}},
                "webhook": {"url": hook, "secretName": HOOK_SECRET},
            },
        },
    }  # fmt: skip


# ------------------------------------------------------------------ what a user sees


def pod_ready(pod: dict[str, Any]) -> bool:
    conds = (pod.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)


def pods(k8s: NodeBackend, name: str, component: str) -> dict[str, dict[str, Any]]:
    """The service's pods of one component, terminating ones left out."""
    selector = f"app.kubernetes.io/instance={name},app.kubernetes.io/component={component}"
    items = k8s.get(NS, "pods", "-l", selector)["items"]
    return {p["metadata"]["name"]: p for p in items if not p["metadata"].get("deletionTimestamp")}


def ready_routers(k8s: NodeBackend, name: str) -> dict[str, str]:
    """Each Ready router pod's name and address, when both are Ready; else empty."""
    ready = {n: p for n, p in pods(k8s, name, "router").items() if pod_ready(p)}
    if len(ready) != 2:
        return {}
    return {n: f"http://{p['status']['podIP']}:{ROUTER_PORT}" for n, p in ready.items()}


def serving(url: str) -> list[str]:
    reps = httpx.get(f"{url}/health/replicas", timeout=5).json()
    return sorted(r["replica"] for r in reps["replicas"] if r["state"] == "serving")


def job_status(url: str, job_id: str) -> dict[str, Any]:
    # A short connect timeout: a deleted router pod's address stops answering at once.
    reply = httpx.get(f"{url}/v1/videos/{job_id}", timeout=httpx.Timeout(30, connect=2))
    assert reply.status_code == 200, reply.text
    job: dict[str, Any] = reply.json()
    return job


def download(url: str, job_id: str) -> bytes:
    reply = httpx.get(f"{url}/v1/videos/{job_id}/content", timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.headers["content-type"] == "video/mp4"
    return reply.content


# ------------------------------------------------------------------ the journey


def test_an_image_link_downloads_after_its_router_pod_is_gone(
    k8s: NodeBackend, store: Store
) -> None:
    routers = eventually(lambda: ready_routers(k8s, IMAGE), 120, "both image router pods")
    (first, url_a), (_, url_b) = sorted(routers.items())
    eventually(lambda: serving(url_a) == ["0"] == serving(url_b), 120, "routers see the replica")
    made = httpx.post(f"{url_a}/v1/images/generations",
                      json={**REQUEST, "response_format": "url"}, timeout=120)  # fmt: skip
    assert made.status_code == 200, made.text
    link = made.json()["data"][0]["url"]
    assert link.startswith(store.server.endpoint_url), link  # the store's, not a router's
    inline = httpx.post(f"{url_b}/v1/images/generations", json=REQUEST, timeout=120)
    assert inline.status_code == 200, inline.text
    png = base64.b64decode(inline.json()["data"][0]["b64_json"])
    assert png.startswith(b"\x89PNG\r\n\x1a\n")

    fetched = httpx.get(link, timeout=30)
    assert fetched.status_code == 200 and fetched.content == png  # same seed, same bytes
    assert fetched.headers["content-type"] == "image/png"
    (key,) = store.keys(f"{PREFIX[IMAGE]}images/")
    assert store.read(key) == png

    uid = pods(k8s, IMAGE, "router")[first]["metadata"]["uid"]
    k8s.kubectl("-n", NS, "delete", "pod", first, *FORCE)
    eventually(lambda: uid not in {p["metadata"]["uid"] for p in k8s.get(NS, "pods")["items"]},
               60, "the router pod gone")  # fmt: skip
    again = httpx.get(link, timeout=30)
    assert again.status_code == 200 and again.content == png


def test_a_video_job_outlives_its_owner_and_both_router_pods(
    k8s: NodeBackend, store: Store, seen: Seen
) -> None:
    routers = eventually(lambda: ready_routers(k8s, VIDEO), 120, "both video router pods")
    url = k8s.router_url(NS, VIDEO)
    eventually(lambda: all(serving(u) == ["0", "1"] for u in routers.values()), 120,
               "both routers see both replicas")  # fmt: skip
    submitted = httpx.post(f"{url}/v1/videos", json=JOB, timeout=60)
    assert submitted.status_code == 200, submitted.text
    job_id = seen.job_id = submitted.json()["id"]

    def running() -> dict[str, Any]:
        now = job_status(url, job_id)
        return now if now["status"] == "in_progress" and now["progress"] > 0 else {}

    owner = f"{VIDEO}-replica-{eventually(running, 120, 'the job to run', 0.1)['replica']}"
    old_routers = pods(k8s, VIDEO, "router")
    involved = {**old_routers, owner: pods(k8s, VIDEO, "replica")[owner]}
    killed = {p["metadata"]["uid"] for p in involved.values()}
    # The routers first, the owner once their replacements are Ready: no router that
    # saw the job placed is alive when its holder goes, so only a router that took the
    # job over from its record in the store can run it again.
    k8s.kubectl("-n", NS, "delete", "pod", *old_routers, *FORCE)
    routers_killed = time.monotonic()

    def a_new_router() -> bool:
        now = pods(k8s, VIDEO, "router")
        return not set(now) & set(old_routers) and any(pod_ready(p) for p in now.values())

    eventually(a_new_router, 120, "a router pod replaced")
    replaced_at = time.monotonic()
    still = job_status(k8s.router_url(NS, VIDEO), job_id)
    assert still["status"] == "in_progress", still  # else the job is too short for the test
    k8s.kubectl("-n", NS, "delete", "pod", owner, *FORCE)
    owner_killed = time.monotonic()

    def finished() -> dict[str, Any]:
        now = job_status(k8s.router_url(NS, VIDEO), job_id)
        return now if now["status"] in ("completed", "failed", "cancelled") else {}

    done = eventually(finished, 300, "the job to finish", 0.5)
    seen.completed_at = time.monotonic()
    assert done["status"] == "completed", done
    assert done["attempt"] == 2, done  # run again: the first run went with its pod
    seen.figures += [
        f"router pods deleted to a replacement Ready: {replaced_at - routers_killed:.1f} s",
        f"owner pod deleted to completed (re-run): {seen.completed_at - owner_killed:.1f} s",
    ]

    # What the replaced routers serve is the re-run's video, from the store.
    video = download(k8s.router_url(NS, VIDEO), job_id)
    assert video[4:8] == b"ftyp"  # an mp4 container
    folder = f"{PREFIX[VIDEO]}videos/{job_id}/"
    assert f"{folder}2.mp4" in store.keys(folder)
    assert store.read(f"{folder}2.mp4") == video

    # Every pod involved replaced (new uids, Ready); each new router pod serves it.
    def replaced() -> dict[str, str]:
        now = ready_routers(k8s, VIDEO)
        fresh = pods(k8s, VIDEO, "replica").get(owner)
        if not now or fresh is None or not pod_ready(fresh):
            return {}
        uids = {p["metadata"]["uid"] for p in pods(k8s, VIDEO, "router").values()}
        return now if not (uids | {fresh["metadata"]["uid"]}) & killed else {}

    routers = eventually(replaced, 300, "every pod involved replaced")
    assert not set(routers) & set(involved)
    for router in routers.values():
        assert download(router, job_id) == video
        assert job_status(router, job_id)["status"] == "completed"
    eventually(lambda: k8s.get(NS, "dsvc", VIDEO)["status"]["readyReplicas"] == 2, 120, "ready")

    # Down to one replica: whichever ran the re-run, the video is still there.
    k8s.kubectl("-n", NS, "scale", f"dsvc/{VIDEO}", "--replicas=1")
    eventually(lambda: set(pods(k8s, VIDEO, "replica")) == {f"{VIDEO}-replica-0"}, 180, "one")
    eventually(lambda: serving(k8s.router_url(NS, VIDEO)) == ["0"], 60, "the router sees one")
    url = k8s.router_url(NS, VIDEO)
    assert download(url, job_id) == video
    after = job_status(url, job_id)
    assert (after["status"], after["attempt"]) == ("completed", 2), after


def test_the_receiver_got_one_verified_event_for_the_job(
    k8s: NodeBackend, store: Store, receiver: Receiver, seen: Seen
) -> None:
    assert seen.job_id, "the video step made no job"
    eventually(lambda: receiver.got, 60, "an event for the job")
    first = receiver.got[0].at
    client = openai.OpenAI(api_key="unused", base_url="http://127.0.0.1:9")
    # Every delivery verifies; a receiver that drops repeats by id sees one event.
    events = [client.webhooks.unwrap(d.body, d.headers, secret=WHSEC) for d in receiver.got]
    assert {e.type for e in events} == {"video.completed"}
    assert [json.loads(d.body)["data"] for d in receiver.got] == [{"id": seen.job_id}] * len(events)
    ids = {d.headers["webhook-id"] for d in receiver.got}
    assert len(ids) == 1 and ids == {e.id for e in events}, ids
    # The job's record goes with DELETE, and its objects with it.
    url = k8s.router_url(NS, VIDEO)
    assert httpx.delete(f"{url}/v1/videos/{seen.job_id}", timeout=60).status_code == 200
    assert httpx.get(f"{url}/v1/videos/{seen.job_id}", timeout=60).status_code == 404
    assert store.keys(f"{PREFIX[VIDEO]}videos/{seen.job_id}/") == []
    seen.figures += [
        f"completed seen to first event: {first - seen.completed_at:+.1f} s",
        f"deliveries: {len(receiver.got)}, distinct event ids: {len(ids)}",
    ]
    print("\n".join(["", "outputs journey figures:", *seen.figures]))
