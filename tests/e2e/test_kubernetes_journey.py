"""The user journey on Kubernetes: helm install → kubectl apply → images, and everything after.

Backends (tests/e2e/backends.py): ``--cluster node`` (default) runs on the real control
plane of tests/cluster with a real node (kubelet, containerd, runc, CNI, kube-proxy),
the images ``make images`` builds, and the router reached through its Service;
``--cluster local`` swaps the node for the test kubelet (pods are local processes, a
faster tier); ``--cluster kind`` uses a kind cluster and needs Docker and kind.
The steps are the same on all three.

Both namespaces (the operator's and the service's) enforce the "restricted" Pod
Security Standard, so every pod the chart and the operator make must pass it, and on
the real node the runtime enforces what it asks for (user 10001, read-only root,
no capabilities). The operator is installed namespaced (``watchNamespaces``): it works
with a Role in the service's namespace and no cluster-wide permission at all.
"""

from __future__ import annotations

import base64
import json
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from dpserve.plumbing.curve import WireKey
from dpserve.router.sessions import session_owner
from tests.e2e.backends import Backend, NodeBackend
from tests.e2e.operator_install import OPERATOR_NS, operator_installed
from tests.polling import eventually
from tests.realtime_client import RealtimeSocket

# Slow on a fresh machine: the images build and the worker image (6 GB) is imported
# into the node once (minutes); later runs find both cached.
pytestmark = [pytest.mark.e2e, pytest.mark.cluster, pytest.mark.timeout(2400)]
REPO = Path(__file__).resolve().parents[2]
NS = "journey"
REQUEST = {"prompt": "a red kite", "size": "64x64", "num_inference_steps": 2, "seed": 9}
WIRE_PROBE = Path(__file__).with_name("wire_probe.py")
LORA = "/models/loras/tiny"  # baked into the worker image (Dockerfile)
API_KEY, ADMIN_KEY = "journey-inference-key", "journey-admin-key"


class Load:
    """Generation requests in a loop from two clients; every failure is recorded."""

    def __init__(self, url: Callable[[], str]) -> None:
        self.url = url
        self.failures: list[str] = []
        self.served: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(2)]

    def _run(self) -> None:
        with httpx.Client(timeout=120) as http:
            while not self._stop.is_set():
                try:
                    url = self.url()
                except LookupError:  # no router pod Ready this instant: nothing was sent
                    time.sleep(0.2)
                    continue
                try:
                    r = http.post(f"{url}/v1/images/generations", json=REQUEST)
                except httpx.HTTPError as exc:
                    self.failures.append(f"transport: {exc!r}")
                    continue
                if r.status_code == 200:
                    self.served.append(r.headers["X-Dpserve-Replica"])
                else:
                    self.failures.append(f"{r.status_code}: {r.text[:300]}")

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=180)


def stage_models(root: Path, tiny_model: Path, tiny_lora: Path, tiny_video: Path) -> Path:
    """The worker image's /models for the test kubelet, laid out as the image has it:
    the models and a LoRA under the one folder workers may load from (the model's
    mountPath), readable by the pods' user (10001), not only root."""
    shutil.copytree(tiny_model, root / tiny_model.name)
    shutil.copytree(tiny_video, root / "tiny-video")
    shutil.copytree(tiny_lora, root / "loras" / "tiny")
    for path in [root, *root.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return root


@pytest.fixture(scope="module")
def k8s(
    backend: Backend,
    tiny_model: Path,
    tiny_lora: Path,
    tiny_video_model: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Backend]:
    root = tmp_path_factory.mktemp("image-models")
    models = stage_models(root, tiny_model, tiny_lora, tiny_video_model)
    backend.provide_files({"/models": models})
    with operator_installed(backend, NS):
        yield backend


def status(k8s: Backend, name: str = "tiny") -> dict[str, Any]:
    return k8s.get(NS, "dsvc", name).get("status") or {}


def serving(k8s: Backend, name: str = "tiny") -> list[str]:
    reps = httpx.get(f"{k8s.router_url(NS, name)}/health/replicas", timeout=5).json()
    return sorted(r["replica"] for r in reps["replicas"] if r["state"] == "serving")


def replica_pods(k8s: Backend, name: str = "tiny") -> dict[str, dict[str, Any]]:
    selector = f"app.kubernetes.io/instance={name},app.kubernetes.io/component=replica"
    items = k8s.get(NS, "pods", "-l", selector)["items"]
    return {p["metadata"]["name"]: p for p in items if not p["metadata"].get("deletionTimestamp")}


def pod_uids(k8s: Backend) -> set[str]:
    """Every pod of the namespace, terminating ones too."""
    return {p["metadata"]["uid"] for p in k8s.get(NS, "pods")["items"]}


def image(response: httpx.Response) -> bytes:
    assert response.status_code == 200, response.text
    return base64.b64decode(response.json()["data"][0]["b64_json"])


def test_the_operator_holds_no_cluster_wide_permission(k8s: Backend) -> None:
    bindings = k8s.get("", "clusterrolebindings", "-l", "app.kubernetes.io/instance=dpserve")
    assert bindings["items"] == []
    (role,) = k8s.get(NS, "roles", "-l", "app.kubernetes.io/instance=dpserve")["items"]
    assert role["metadata"]["name"] == "dpserve"


def test_the_namespaces_enforce_the_restricted_standard(k8s: Backend) -> None:
    """The proof below has teeth: a pod running as root is refused in both namespaces."""
    rooted = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "rooted"},
        "spec": {"containers": [{"name": "c", "image": "busybox", "command": ["sleep", "1"]}]},
    }
    for namespace in (NS, OPERATOR_NS):
        refused = k8s.kubectl("-n", namespace, "apply", "-f", "-", input=json.dumps(rooted),
                              check=False)  # fmt: skip
        assert refused.returncode != 0
        assert 'violates PodSecurity "restricted:latest"' in refused.stderr, refused.stderr


def test_journey(k8s: Backend) -> None:
    # 2. apply the example; the CR becomes Ready; kubectl shows the printer columns.
    k8s.kubectl("-n", NS, "apply", "-f", str(REPO / "examples/diffusionservice-cpu.yaml"))
    # Ready means servable: the router is available too, so a request right after
    # `kubectl wait` is answered.
    k8s.kubectl("-n", NS, "wait", "--for=condition=Ready", "dsvc/tiny", "--timeout=300s")
    assert status(k8s).get("readyReplicas") == 2
    url = k8s.router_url(NS, "tiny")
    assert httpx.post(f"{url}/v1/images/generations", json=REQUEST, timeout=120).status_code == 200
    header = k8s.kubectl("-n", NS, "get", "dsvc").stdout.splitlines()[0].split()
    assert header == ["NAME", "READY", "REPLICAS", "PARALLEL", "MODEL", "AGE"]

    # 2b. locked down: the wire key Secret and the NetworkPolicy exist (enforced on the
    # real node only: test_the_replicas_admit_the_router_alone); replica pods hold no
    # API token.
    assert set(k8s.get(NS, "secret", "tiny-wire")["data"]) == {"wire.key"}
    policy = k8s.get(NS, "networkpolicy", "tiny-replicas")["spec"]
    admitted = policy["ingress"][0]["from"][0]["podSelector"]["matchLabels"]
    assert admitted["app.kubernetes.io/component"] == "router"
    assert policy["ingress"][0]["ports"] == [{"protocol": "TCP", "port": 5575}]
    for pod in replica_pods(k8s).values():
        assert pod["spec"]["automountServiceAccountToken"] is False
        assert pod["spec"]["securityContext"]["runAsUser"] == 10001

    # 3. through the router: both replicas serve, same seed ⇒ same bytes.
    eventually(lambda: serving(k8s) == ["0", "1"], 120, "router sees both replicas")
    with httpx.Client(base_url=url, timeout=120) as http:
        first = http.post("/v1/images/generations", json=REQUEST)
        second = http.post("/v1/images/generations", json=REQUEST)
    assert {first.headers["X-Dpserve-Replica"], second.headers["X-Dpserve-Replica"]} == {"0", "1"}
    assert image(first) == image(second)

    # 3a. the image API through the router pod as through `serve`: streamed previews
    # (OpenAI's SSE events, the request's id on each) and an edit from a multipart form.
    with httpx.Client(base_url=url, timeout=120) as http:
        streamed = {**REQUEST, "num_inference_steps": 4, "stream": True, "partial_images": 2}
        headers = {"X-Request-Id": "journey-stream"}
        with http.stream(
            "POST", "/v1/images/generations", json=streamed, headers=headers
        ) as events:
            assert events.status_code == 200
            data = [json.loads(x[5:]) for x in events.iter_lines() if x.startswith("data:")]
        assert [e["type"] for e in data] == [
            "image_generation.partial_image",
            "image_generation.partial_image",
            "image_generation.completed",
        ]
        assert {e["id"] for e in data} == {"journey-stream"}
        edited = http.post(
            "/v1/images/edits",
            files={"image": ("in.png", image(first), "image/png")},
            data={"prompt": "a blue kite", "seed": "3", "num_inference_steps": "4"},
        )
        assert edited.status_code == 200, edited.text
        assert edited.json()["size"] == "64x64"

    # 3b. a realtime session through the router pod: the session id names its owner
    # pod's address (from the EndpointSlices), and every frame comes from that pod.
    session = RealtimeSocket(url)
    ack, first_frame = session.init(
        prompt="a kite", size="64x64", num_inference_steps=2, mode="step"
    )
    owner = int(ack["replica"])
    pod = replica_pods(k8s)[f"tiny-replica-{owner}"]
    assert session_owner(ack["session_id"]).startswith(f"tcp://{pod['status']['podIP']}:")
    assert [f["replica"] for f in (first_frame, session.step(), session.step())] == [owner] * 3

    with Load(lambda: k8s.router_url(NS, "tiny")) as load:
        # 4. scale out and in: the router follows within seconds, nothing fails; the
        # live session stays on its owner when a replica joins.
        k8s.kubectl("-n", NS, "scale", "dsvc/tiny", "--replicas=3")
        eventually(lambda: serving(k8s) == ["0", "1", "2"], 240, "router sees 3")
        frame = session.step(prompt="a kite at night")
        assert (frame["replica"], frame["index"]) == (owner, 3)
        session.close()
        k8s.kubectl("-n", NS, "scale", "dsvc/tiny", "--replicas=1")
        eventually(lambda: serving(k8s) == ["0"], 60, "router sees 1")
        eventually(lambda: set(replica_pods(k8s)) == {"tiny-replica-0"}, 120, "pods gone")

        # 9. a control op reaches every replica, even with the control-state ConfigMap
        # gone (the state lives in the replicas too); one created later gets it first.
        k8s.kubectl("-n", NS, "delete", "configmap", "tiny-control-state")
        body = {"lora_nickname": "style", "lora_path": LORA}
        done = httpx.post(f"{url}/v1/set_lora", json=body, timeout=120)
        assert done.status_code == 200, done.text
        assert done.json()["control_state"]["replicas_holding"] == 1
        k8s.kubectl("-n", NS, "scale", "dsvc/tiny", "--replicas=2")
        eventually(lambda: serving(k8s) == ["0", "1"], 240, "router sees 2 again")
        listed = httpx.get(f"{url}/v1/list_loras", timeout=60).json()
        assert listed["consistent"] is True and len(listed["replicas"]) == 2
        assert [x["nickname"] for x in listed["result"]["loaded"]] == ["style"]

        # 5. a replica pod deleted under load is recreated; nothing fails. The old pod
        # is gone in seconds, not at the end of its grace period (request timeout + 30 s):
        # SIGTERM reaches the worker, PID 1 of its container (where a signal without a
        # handler is ignored), which drains and exits.
        uid = replica_pods(k8s)["tiny-replica-1"]["metadata"]["uid"]
        deleted_at = time.monotonic()
        k8s.kubectl("-n", NS, "delete", "pod", "tiny-replica-1", "--wait=false")
        eventually(lambda: uid not in pod_uids(k8s), 120, "the deleted pod gone")
        assert time.monotonic() - deleted_at < 60
        eventually(lambda: replica_pods(k8s).get("tiny-replica-1", {}).get("metadata", {})
                   .get("uid") not in (None, uid), 120, "replacement pod")  # fmt: skip
        eventually(lambda: serving(k8s) == ["0", "1"], 240, "replacement serving")

        # 6. a spec change rolls the pods one at a time; status tells the truth.
        patch = {"spec": {"env": [{"name": "DPSERVE_JOURNEY", "value": "2"}]}}
        k8s.kubectl("-n", NS, "patch", "dsvc", "tiny", "--type=merge", "-p", json.dumps(patch))
        generation = k8s.get(NS, "dsvc", "tiny")["metadata"]["generation"]
        lowest_ready = 2

        def rolled() -> bool:
            nonlocal lowest_ready
            st = status(k8s)
            assert st.get("updatedReplicas", 0) <= 2
            lowest_ready = min(lowest_ready, st.get("readyReplicas", 0))
            return st.get("observedGeneration") == generation and st.get(
                "updatedReplicas"
            ) == 2 == st.get("readyReplicas")

        eventually(rolled, 420, "the roll")
        assert lowest_ready >= 1  # maxUnavailable 1
        eventually(lambda: serving(k8s) == ["0", "1"], 120, "both serving after the roll")
        rolled_at = len(load.served)
        eventually(lambda: {"0", "1"} <= set(load.served[rolled_at:]), 120, "the load on both")
    assert load.failures == [], load.failures[:5]
    assert {"0", "1"} <= set(load.served)

    # 10. API keys from a Secret named in the spec: the router rolls, then asks for them.
    keys = {"api-keys": f"# journey\n{API_KEY}\n", "admin-keys": f"{ADMIN_KEY}\n"}
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "tiny-api-keys"},
              "stringData": keys}  # fmt: skip
    k8s.kubectl("-n", NS, "apply", "-f", "-", input=json.dumps(secret))
    patch = {"spec": {"router": {"auth": {"secretName": "tiny-api-keys"}}}}
    k8s.kubectl("-n", NS, "patch", "dsvc", "tiny", "--type=merge", "-p", json.dumps(patch))

    def post(path: str, key: str | None, body: dict[str, Any]) -> int:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        try:
            url = k8s.router_url(NS, "tiny")
            # A short connect timeout: the old router pod's address stops answering at once.
            timeout = httpx.Timeout(120, connect=2)
            return httpx.post(
                f"{url}{path}", json=body, headers=headers, timeout=timeout
            ).status_code
        except (LookupError, TimeoutError, httpx.HTTPError):
            return 0  # the router is rolling (TimeoutError: its Service had no endpoint)

    eventually(lambda: post("/v1/images/generations", None, REQUEST) == 401, 180, "keys asked")
    assert post("/v1/images/generations", API_KEY, REQUEST) == 200
    assert post("/v1/images/generations", ADMIN_KEY, REQUEST) == 200
    lora = {"lora_nickname": "style", "lora_path": LORA}
    assert post("/v1/set_lora", API_KEY, lora) == 403  # an inference key on a control route
    assert post("/v1/set_lora", ADMIN_KEY, lora) == 200


def probe_pod(router: dict[str, Any], name: str, labels: dict[str, str], *args: str) -> Any:
    """A one-shot pod of the router's image (and its restricted-standard security
    context) that runs tests/e2e/wire_probe.py; never Ready, so a copy of the router's
    labels never makes it an endpoint of the router's Service."""
    container = router["spec"]["containers"][0]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "restartPolicy": "Never",
            "automountServiceAccountToken": False,
            "securityContext": router["spec"].get("securityContext", {}),
            "containers": [
                {
                    "name": "probe",
                    "image": container["image"],
                    "imagePullPolicy": container.get("imagePullPolicy", "IfNotPresent"),
                    "securityContext": container.get("securityContext", {}),
                    "command": ["python", "-c", WIRE_PROBE.read_text(), *args],
                    "readinessProbe": {"exec": {"command": ["false"]}},
                }
            ],
        },
    }


def run_probe(k8s: Backend, pod: dict[str, Any], ns: str = NS) -> tuple[str, str]:
    """The probe's output and its pod IP, once it has run."""
    name = pod["metadata"]["name"]
    k8s.kubectl("-n", ns, "apply", "-f", "-", input=json.dumps(pod))

    def finished() -> dict[str, Any]:
        got: dict[str, Any] = k8s.get(ns, "pod", name)
        return got if got["status"].get("phase") in ("Succeeded", "Failed") else {}

    done = eventually(finished, 120, f"probe {name} ran")
    logs = k8s.kubectl("-n", ns, "logs", name).stdout
    k8s.kubectl("-n", ns, "delete", "pod", name, "--wait=false")
    assert done["status"]["phase"] == "Succeeded", logs
    return logs, done["status"]["podIP"]


@dataclass(frozen=True)
class ReplicaDoor:
    """What a probe of a service's replica ports needs: the router pod (its image and
    security context), the labels the replicas' NetworkPolicy admits, the ZMQ port and
    the service's public wire key."""

    router: dict[str, Any]
    router_labels: dict[str, str]
    port: str
    public: str

    def stranger(self, name: str, ip: str) -> dict[str, Any]:
        """A probe pod without the router's labels, aimed at the replica at ``ip``."""
        return probe_pod(self.router, name, {"test": "netpol"}, ip, self.port, self.public)


def replica_door(k8s: Backend, ns: str, service: str = "tiny") -> ReplicaDoor:
    policy = k8s.get(ns, "networkpolicy", f"{service}-replicas")["spec"]
    labels = policy["ingress"][0]["from"][0]["podSelector"]["matchLabels"]
    routers = k8s.get(ns, "pods", "-l", ",".join(f"{k}={v}" for k, v in labels.items()))
    secret = k8s.get(ns, "secret", f"{service}-wire")["data"]["wire.key"]
    return ReplicaDoor(
        router=routers["items"][0],
        router_labels=labels,
        port=str(policy["ingress"][0]["ports"][0]["port"]),
        public=WireKey.from_secret(base64.b64decode(secret).strip()).public.decode(),
    )


def test_the_replicas_admit_the_router_alone(k8s: Backend) -> None:
    """The NetworkPolicy enforced (kube-router on the real node, tests/cluster/policy.py):
    a pod without the router's labels cannot open a replica's ZMQ port; one that copies
    them can (labels are self-asserted), and the wire key stops it there; the router
    still serves. Runs on the state test_journey leaves (tiny, with API keys)."""
    if not isinstance(k8s, NodeBackend):
        pytest.skip("NetworkPolicy is enforced only on --cluster node (docs/test-cluster.md)")
    door = replica_door(k8s, NS)
    (replica, *_) = replica_pods(k8s).values()
    ip = replica["status"]["podIP"]

    logs, _ = run_probe(k8s, door.stranger("stranger", ip))
    assert logs.startswith("tcp: ") and "tcp: open" not in logs, logs

    copycat_labels = {**door.router_labels, "test": "netpol"}
    copycat = probe_pod(door.router, "copycat", copycat_labels, ip, door.port, door.public)
    logs, copycat_ip = run_probe(k8s, copycat)
    assert logs.splitlines() == ["tcp: open", "generate: no reply"], logs
    # The replica's gatekeeper saw it and said so (dpserve.plumbing.curve.Gatekeeper).
    denied = f"denied a CURVE peer from {copycat_ip}"
    logs_of = ("-n", NS, "logs", replica["metadata"]["name"])
    eventually(lambda: denied in k8s.kubectl(*logs_of).stdout, 30, "the replica logs the peer")

    url = k8s.router_url(NS, "tiny")
    headers = {"Authorization": f"Bearer {API_KEY}"}
    served = httpx.post(f"{url}/v1/images/generations", json=REQUEST, headers=headers, timeout=120)
    assert served.status_code == 200, served.text


def test_crd_refuses_invalid_specs(k8s: Backend) -> None:
    bad = {
        "apiVersion": "dpserve.dev/v1alpha1",
        "kind": "DiffusionService",
        "metadata": {"name": "bad", "namespace": NS},
        "spec": {"model": {"path": "/m"}, "role": "denoiser", "replicas": 2},
    }
    refused = k8s.kubectl("apply", "-f", "-", input=json.dumps(bad), check=False)
    assert refused.returncode != 0
    assert "data-parallel replicas need role monolithic" in refused.stderr
    bad["spec"] = {"model": {"path": "/m"}, "parallelism": {"sp": 2, "ulysses": 2, "ring": 2}}
    refused = k8s.kubectl("apply", "-f", "-", input=json.dumps(bad), check=False)
    assert "ulysses * parallelism.ring must equal parallelism.sp" in refused.stderr


def test_a_gang_of_two_ranks_serves_from_one_pod(k8s: Backend) -> None:
    """cfg 2 on the CPU: two ranks in one container, a gloo group over loopback and
    /dev/shm (a memory emptyDir), under the same locked-down security context; the
    image is byte-identical to a one-rank replica's for the seed."""
    pair = {
        "apiVersion": "dpserve.dev/v1alpha1",
        "kind": "DiffusionService",
        "metadata": {"name": "pair", "namespace": NS},
        "spec": {"model": {"path": "/models/tiny"}, "device": "cpu", "threadsPerRank": 1,
                 "maxSequenceLength": 77, "replicas": 1, "parallelism": {"cfg": 2}},
    }  # fmt: skip
    k8s.kubectl("apply", "-f", "-", input=json.dumps(pair))
    try:
        k8s.kubectl("-n", NS, "wait", "--for=condition=Ready", "dsvc/pair", "--timeout=300s")
        # True CFG: the two branches go one to each rank (docs/worker.md, CFG parallel).
        body = {**REQUEST, "true_cfg_scale": 4.0, "negative_prompt": "blur"}
        served = httpx.post(
            f"{k8s.router_url(NS, 'pair')}/v1/images/generations", json=body, timeout=120
        )
        info = httpx.get(f"{k8s.router_url(NS, 'pair')}/health/replicas", timeout=10).json()
        assert [r["state"] for r in info["replicas"]] == ["serving"]
        # The journey's one-rank service (keyed since step 10, holding the LoRA since
        # step 9) makes the same bytes once this one holds the LoRA too.
        lora = {"lora_nickname": "style", "lora_path": LORA}
        set_lora = httpx.post(f"{k8s.router_url(NS, 'pair')}/v1/set_lora", json=lora, timeout=120)
        assert set_lora.status_code == 200, set_lora.text
        served = httpx.post(
            f"{k8s.router_url(NS, 'pair')}/v1/images/generations", json=body, timeout=120
        )
        alone = httpx.post(
            f"{k8s.router_url(NS, 'tiny')}/v1/images/generations", json=body, timeout=120,
            headers={"Authorization": f"Bearer {API_KEY}"},
        )  # fmt: skip
        assert image(served) == image(alone)
    finally:
        k8s.kubectl("-n", NS, "delete", "dsvc", "pair", "--wait=false", check=False)


def test_a_video_job_outlives_its_owner_pod(k8s: Backend) -> None:
    """A video job through the router pod; its owner pod is killed while it runs. The
    router that placed it runs it again on the other replica (same id, same seed), the
    operator recreates the pod, and status says so: docs/video.md."""
    vid = {
        "apiVersion": "dpserve.dev/v1alpha1",
        "kind": "DiffusionService",
        "metadata": {"name": "vid", "namespace": NS},
        "spec": {"model": {"path": "/models/tiny-video"}, "device": "cpu", "replicas": 2,
                 "threadsPerRank": 1, "video": {"maxFrames": 33, "ttlSeconds": 600}},
    }  # fmt: skip
    k8s.kubectl("apply", "-f", "-", input=json.dumps(vid))
    try:
        k8s.kubectl("-n", NS, "wait", "--for=condition=Ready", "dsvc/vid", "--timeout=300s")
        url = k8s.router_url(NS, "vid")
        eventually(
            lambda: serving(k8s, "vid") == ["0", "1"], 120, "router sees both video replicas"
        )
        # Long enough that the kill lands while it runs: a few seconds on one thread, most
        # of it decoding and encoding 33 frames (a smaller job can finish between looks).
        job = {"prompt": "a kite in the wind", "size": "192x144", "num_frames": 33, "seed": 5,
               "num_inference_steps": 100}  # fmt: skip
        with httpx.Client(base_url=url, timeout=60) as http:
            submitted = http.post("/v1/videos", json=job)
            assert submitted.status_code == 200, submitted.text
            job_id = submitted.json()["id"]
            early = http.get(f"/v1/videos/{job_id}/content")
            assert early.status_code == 409 and "content is not ready" in early.text

            def running() -> dict[str, Any] | None:
                now = http.get(f"/v1/videos/{job_id}").json()
                return now if now["status"] == "in_progress" and now["progress"] > 0 else None

            owner = eventually(running, 120, "the job to run")["replica"]
            pods = replica_pods(k8s, "vid")
            killed = pods[f"vid-replica-{owner}"]["metadata"]["uid"]
            k8s.kubectl("-n", NS, "delete", "pod", f"vid-replica-{owner}", "--grace-period=0",
                        "--force", "--wait=false")  # fmt: skip

            def finished() -> dict[str, Any] | None:
                now = http.get(f"/v1/videos/{job_id}").json()
                return now if now["status"] in ("completed", "failed", "cancelled") else None

            done = eventually(finished, 600, "the job to finish")
            assert done["status"] == "completed", done
            # (The re-run's replica index may be the owner's again: its pod is recreated
            # under the same name, and may be Ready before the re-run is placed.)
            assert done["attempt"] == 2, done
            video = http.get(f"/v1/videos/{job_id}/content")
            assert video.status_code == 200 and video.headers["content-type"] == "video/mp4"
            assert video.content[4:8] == b"ftyp"  # an mp4 container
        # Status is true throughout: the operator recreates the killed pod and reports
        # both replicas ready again.
        eventually(
            lambda: replica_pods(k8s, "vid").get(f"vid-replica-{owner}", {}).get("metadata", {})
            .get("uid") not in (None, killed), 180, "the owner pod recreated",
        )  # fmt: skip
        eventually(lambda: status(k8s, "vid").get("readyReplicas") == 2, 300, "both ready again")
    finally:
        k8s.kubectl("-n", NS, "delete", "dsvc", "vid", "--wait=false", check=False)


def test_more_gpus_than_the_node_has_is_degraded(k8s: Backend) -> None:
    greedy = {
        "apiVersion": "dpserve.dev/v1alpha1",
        "kind": "DiffusionService",
        "metadata": {"name": "greedy", "namespace": NS},
        # 3 replicas x cfg 2 = 6 GPUs; the node has 4. The image never matters: the
        # third pod is never scheduled, and the point is what status says about it.
        "spec": {"model": {"path": "/models/tiny"}, "replicas": 3, "parallelism": {"cfg": 2}},
    }
    k8s.kubectl("apply", "-f", "-", input=json.dumps(greedy))
    try:

        def unschedulable() -> dict[str, Any] | None:
            st = status(k8s, "greedy")
            return next(
                (r for r in st.get("replicaStatuses", []) if r.get("reason") == "Unschedulable"),
                None,
            )

        stuck = eventually(unschedulable, 120, "an unschedulable replica")
        assert "nvidia.com/gpu" in stuck["message"]
        degraded = next(c for c in status(k8s, "greedy")["conditions"] if c["type"] == "Degraded")
        assert degraded["status"] == "True"
    finally:
        k8s.kubectl("-n", NS, "delete", "dsvc", "greedy", "--wait=false", check=False)


def test_delete_collects_every_child(k8s: Backend) -> None:
    k8s.kubectl("-n", NS, "delete", "dsvc", "tiny", "--wait=false")
    kinds = (
        "pods,services,deployments,serviceaccounts,roles,rolebindings,configmaps,"
        "secrets,networkpolicies,poddisruptionbudgets"
    )

    def leftovers() -> list[str]:
        listed = k8s.get(NS, kinds, "-l", "app.kubernetes.io/instance=tiny")["items"]
        return [f"{o['kind']}/{o['metadata']['name']}" for o in listed]

    eventually(lambda: leftovers() == [], 180, "garbage collection")
