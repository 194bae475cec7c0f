"""The Kubernetes journey of model.source (docs/models.md, On Kubernetes), on a real node.

A real S3 server listens on the node's bridge gateway (the host as pods see it),
behind a CountingProxy there that counts the bytes it serves and throttles them, so
a fill of the tiny model (4.8 MB) takes about 25 s and its progress can be seen. The
cache is a hostPath PersistentVolume (ReadWriteMany, Retain) with a claim bound to it
by name; the store's AWS_* variables are a Secret. Each step is asserted through what
a user sees: the DiffusionService's status, conditions and Events, ``kubectl get
dsvc``, the pods' specs, and images through the router:

1. the first fill: replicas held (no pod) until the entry is fetched, once for both;
2. a new source fills a new entry while the replicas serve the old one (a replica
   lost meanwhile comes back on it), then they roll onto it;
3. a corrupt object fails the fill at once and the replicas keep serving;
4. deleting the DiffusionService takes its fill Jobs with it;
5. a node-local cache (a host folder, no claim): two replicas on the one node, each
   fetching in its init container, move one model's bytes between them.

Only ``--cluster node``: pods of the test kubelet or kind reach neither the gateway
nor a hostPath volume of this host.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.backends import NodeBackend
from tests.e2e.operator_install import operator_installed
from tests.polling import eventually
from tests.storage.proxy import CountingProxy
from tests.storage.s3 import S3Server, build_server, running_s3, upload_folder

# As the other journey: the images build and reach the node first (minutes when cold).
pytestmark = [pytest.mark.e2e, pytest.mark.cluster, pytest.mark.s3, pytest.mark.timeout(2400)]
NS = "model-source"
NAME = "tiny"
SECRET = "model-store"
CLAIM = "model-cache"
VOLUME = "dpserve-e2e-model-cache"  # cluster-scoped: named for this module
POD_USER = 10001  # the pods' user: the hostPath folder must be writable by it
KiB = 1024
# The tiny model's VAE (4.1 MB of its 4.8) comes on one connection: about 25 s.
FILL_RATE = 160 * KiB
# While a replica comes back during the second fill: slow enough (minutes) that the
# fill is still running when it is Ready; released then.
HELD_RATE = 16 * KiB
REQUEST = {"prompt": "a red kite", "size": "64x64", "num_inference_steps": 2, "seed": 9}
CORRUPT = "transformer/diffusion_pytorch_model.safetensors"


@dataclass(frozen=True)
class Store:
    server: S3Server
    proxy: CountingProxy
    bucket: str

    def source(self, prefix: str) -> str:
        return f"s3://{self.bucket}/{prefix}/"


@dataclass
class Seen:
    """What one step leaves for the next: the entries replicas loaded and their images."""

    v1_path: str = ""
    v1_image: bytes = b""
    v2_path: str = ""
    v2_image: bytes = b""
    figures: list[str] = field(default_factory=list)


# ------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def node(request: pytest.FixtureRequest) -> NodeBackend:
    if request.config.getoption("--cluster") != "node":
        pytest.skip("model.source's journey needs --cluster node (the gateway, hostPath)")
    backend = request.getfixturevalue("backend")
    assert isinstance(backend, NodeBackend)
    return backend


@pytest.fixture(scope="module")
def k8s(node: NodeBackend) -> Iterator[NodeBackend]:
    # Node-local caches are hostPath volumes: the chart's switch allows them (step 5).
    with operator_installed(node, NS, "--set=allowHostPathModels=true"):
        yield node


@pytest.fixture(scope="module")
def store(node: NodeBackend, tiny_model: Path, tiny_model_b: Path) -> Iterator[Store]:
    """The S3 server and its proxy on the gateway; the tiny model under ``tiny-v1/``,
    other weights of its architecture under ``tiny-v2/``, each file with a SHA-256."""
    gateway = node.cluster.network.gateway
    with (
        running_s3(build_server(), host=gateway) as server,
        CountingProxy(server.endpoint_url, listen_host=gateway) as proxy,
    ):
        bucket = server.new_bucket("models")
        upload_folder(server.client(), bucket, "tiny-v1", tiny_model, sha256=True)
        upload_folder(server.client(), bucket, "tiny-v2", tiny_model_b, sha256=True)
        yield Store(server, proxy, bucket)


@pytest.fixture(scope="module")
def credentials(k8s: NodeBackend, store: Store) -> str:
    """The Secret the fill Job reads: the store's variables, its endpoint the proxy."""
    env = {**store.server.env(), "AWS_ENDPOINT_URL": store.proxy.url}
    secret = {"apiVersion": "v1", "kind": "Secret",
              "metadata": {"name": SECRET, "namespace": NS}, "stringData": env}  # fmt: skip
    k8s.kubectl("apply", "-f", "-", input=json.dumps(secret))
    return SECRET


@pytest.fixture(scope="module")
def claim(k8s: NodeBackend, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A claim bound by name to a hostPath volume on a fresh folder of this host.
    (The restricted standard forbids hostPath volumes in pods, not claims bound to one;
    the kubelet applies no fsGroup to hostPath, hence the chown.)"""
    folder = tmp_path_factory.mktemp("model-cache")
    os.chown(folder, POD_USER, POD_USER)
    folder.chmod(0o755)
    volume = {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": VOLUME},
        "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteMany"],
                 "persistentVolumeReclaimPolicy": "Retain", "storageClassName": "",
                 "hostPath": {"path": str(folder), "type": "Directory"}},
    }  # fmt: skip
    pvc = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": CLAIM, "namespace": NS},
        "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": "",
                 "volumeName": VOLUME, "resources": {"requests": {"storage": "1Gi"}}},
    }  # fmt: skip
    for obj in (volume, pvc):
        k8s.kubectl("apply", "-f", "-", input=json.dumps(obj))
    eventually(lambda: k8s.get(NS, "pvc", CLAIM)["status"].get("phase") == "Bound", 60, "bound")
    try:
        yield CLAIM
    finally:
        # A journey that stopped half-way leaves its service: its pods hold the claim.
        k8s.kubectl("-n", NS, "delete", "dsvc", NAME, "--ignore-not-found", "--timeout=120s",
                    check=False)  # fmt: skip
        k8s.kubectl("-n", NS, "delete", "pvc", CLAIM, "--wait=false", check=False)
        k8s.kubectl("delete", "pv", VOLUME, "--wait=false", check=False)


@pytest.fixture(scope="module")
def seen() -> Seen:
    return Seen()


# ------------------------------------------------------------------ what a user sees


def service(source: str) -> dict[str, Any]:
    return {
        "apiVersion": "dpserve.dev/v1alpha1",
        "kind": "DiffusionService",
        "metadata": {"name": NAME, "namespace": NS},
        "spec": {
            "model": {"source": source, "credentials": {"secretName": SECRET},
                      "cache": {"claimName": CLAIM}},
            "device": "cpu", "replicas": 2, "threadsPerRank": 1, "maxSequenceLength": 77,
            "resources": {"requests": {"cpu": "250m", "memory": "512Mi"},
                          "limits": {"memory": "2Gi"}},
        },
    }  # fmt: skip


def patch_source(k8s: NodeBackend, source: str) -> None:
    body = json.dumps({"spec": {"model": {"source": source}}})
    k8s.kubectl("-n", NS, "patch", "dsvc", NAME, "--type=merge", "-p", body)


def status(k8s: NodeBackend) -> dict[str, Any]:
    return k8s.get(NS, "dsvc", NAME).get("status") or {}


def condition(st: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in st.get("conditions") or [] if c["type"] == kind), {})


def model_column(k8s: NodeBackend) -> str:
    """The MODEL cell of ``kubectl get dsvc``: the header's offsets, as kubectl aligns
    them (the cell holds spaces: ``Fetching 41% (1.2 MB of 4.8 MB), …``)."""
    header, row = k8s.kubectl("-n", NS, "get", "dsvc", NAME).stdout.splitlines()[:2]
    start = header.index("MODEL")
    after = header[start + len("MODEL") :]
    end = start + len("MODEL") + len(after) - len(after.lstrip())
    return row[start:end].strip()


def replica_pods(k8s: NodeBackend, name: str = NAME) -> dict[str, dict[str, Any]]:
    selector = f"app.kubernetes.io/instance={name},app.kubernetes.io/component=replica"
    items = k8s.get(NS, "pods", "-l", selector)["items"]
    return {p["metadata"]["name"]: p for p in items if not p["metadata"].get("deletionTimestamp")}


def model_arg(pod: dict[str, Any]) -> str:
    args: list[str] = pod["spec"]["containers"][0]["args"]
    for i, arg in enumerate(args):
        if arg == "--model":
            return args[i + 1]
        if arg.startswith("--model="):
            return arg.split("=", 1)[1]
    raise AssertionError(f"no --model in {args}")


def pod_ready(pod: dict[str, Any]) -> bool:
    conds = (pod.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)


def fill_jobs(k8s: NodeBackend) -> dict[str, dict[str, Any]]:
    selector = f"app.kubernetes.io/instance={NAME},app.kubernetes.io/component=model-fill"
    return {j["metadata"]["name"]: j for j in k8s.get(NS, "jobs", "-l", selector)["items"]}


def job_of(k8s: NodeBackend, source: str) -> dict[str, Any] | None:
    by_source = {
        j["metadata"]["annotations"]["dpserve.dev/model-source"]: j for j in fill_jobs(k8s).values()
    }
    return by_source.get(source)


def job_finished(job: dict[str, Any] | None, kind: str) -> bool:
    conds = ((job or {}).get("status") or {}).get("conditions") or []
    return any(c["type"] == kind and c["status"] == "True" for c in conds)


def fill_exited_0(pod: dict[str, Any]) -> bool:
    states = [
        cs.get("state") or {} for cs in (pod.get("status") or {}).get("containerStatuses") or []
    ]
    return any((st.get("terminated") or {}).get("exitCode") == 0 for st in states)


def events(k8s: NodeBackend, reason: str, name: str = NAME) -> list[dict[str, Any]]:
    items = k8s.get(NS, "events")["items"]
    return [e for e in items if e["involvedObject"]["name"] == name and e["reason"] == reason]


def generate(k8s: NodeBackend, name: str = NAME) -> bytes:
    reply = httpx.post(
        f"{k8s.router_url(NS, name)}/v1/images/generations", json=REQUEST, timeout=120
    )
    assert reply.status_code == 200, reply.text
    return base64.b64decode(reply.json()["data"][0]["b64_json"])


def dry_run_revision(server: S3Server, source: str, cache: Path) -> str:
    """What ``dpserve fetch --dry-run`` says the source is at, asked of the server
    directly (the proxy counts only what the cluster fetched)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")} | server.env()
    cmd = [sys.executable, "-m", "dpserve", "fetch", source, "--model-cache", str(cache),
           "--dry-run"]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return str(json.loads(done.stdout)["revision"])


def _time(stamp: str) -> float:
    return datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc).timestamp()


def model_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


@dataclass
class FirstFill:
    """Looks at the service while its first fill runs; what it saw, asserted after."""

    k8s: NodeBackend
    partial: list[dict[str, Any]] = field(default_factory=list)
    columns: list[str] = field(default_factory=list)
    held: list[tuple[list[str], str]] = field(default_factory=list)  # phases, Ready reason
    early_pods: list[str] = field(default_factory=list)
    fetching_since: float | None = None

    def look(self) -> bool:
        # Replica pods first, then the fill pod: one that had not exited 0 when read
        # after them had not when they were listed, so no replica pod may have existed.
        pods = replica_pods(self.k8s)
        fill = self.k8s.get(NS, "pods", "-l", "app.kubernetes.io/component=model-fill")
        if not any(fill_exited_0(p) for p in fill["items"]):
            self.early_pods += list(pods)
        st = status(self.k8s)
        fetch = (st.get("model") or {}).get("fetch") or {}
        if fetch.get("state") == "Fetching":
            self.fetching_since = self.fetching_since or time.monotonic()
            if fetch["bytesDone"] < fetch["bytesTotal"]:
                self.partial.append(fetch)
        if not st.get("replicaStatuses"):
            return False  # not reconciled yet
        if condition(st, "ModelReady").get("status") != "True":
            phases = [r["phase"] for r in st.get("replicaStatuses") or []]
            self.held.append((phases, condition(st, "Ready").get("reason", "")))
            self.columns.append(model_column(self.k8s))
            return False
        return True


# ------------------------------------------------------------------ the journey


def test_a_source_is_fetched_once_then_both_replicas_serve_it(
    k8s: NodeBackend,
    store: Store,
    credentials: str,
    claim: str,
    seen: Seen,
    tiny_model: Path,
    tmp_path: Path,
) -> None:
    source = store.source("tiny-v1")
    revision = dry_run_revision(store.server, source, tmp_path / "dry")
    store.proxy.rate = FILL_RATE
    before = store.proxy.sent
    applied = time.monotonic()
    k8s.kubectl("apply", "-f", "-", input=json.dumps(service(source)))
    watch = FirstFill(k8s)
    eventually(watch.look, 240, "the first fill", poll_s=0.5)
    fetched = time.monotonic()

    # While it ran: progress in status and in `kubectl get`; replicas held, no pod.
    assert watch.partial, "status.model.fetch never showed a fill under way"
    assert any(c.startswith("Fetching ") and "%" in c for c in watch.columns), watch.columns
    assert watch.held and all(
        phases == ["WaitingForModel"] * 2 and reason == "WaitingForModel"
        for phases, reason in watch.held
    ), watch.held
    assert watch.early_pods == []
    started = events(k8s, "FetchStarted")
    assert len(started) == 1 and source in started[0]["message"]

    # Fetched: the revision `dpserve fetch --dry-run` names; Event; then both serve.
    st = status(k8s)
    loaded = st["model"]["loaded"]
    assert (loaded["source"], loaded["revision"], loaded["claim"]) == (source, revision, CLAIM)
    assert loaded["bytes"] == model_bytes(tiny_model)
    assert st["model"]["progress"] == "Ready" and model_column(k8s) == "Ready"
    assert condition(st, "ModelReady")["reason"] == "Fetched"
    (finished,) = events(k8s, "FetchFinished")
    assert finished["type"] == "Normal" and revision in finished["message"]
    k8s.kubectl("-n", NS, "wait", "--for=condition=Ready", f"dsvc/{NAME}", "--timeout=300s")
    ready = time.monotonic()
    pods = replica_pods(k8s)
    assert sorted(pods) == [f"{NAME}-replica-0", f"{NAME}-replica-1"]
    assert {model_arg(p) for p in pods.values()} == {loaded["path"]}
    seen.v1_path = loaded["path"]
    seen.v1_image = generate(k8s)

    # One model's bytes through the proxy, though two replicas load it.
    moved = store.proxy.sent - before
    total = model_bytes(tiny_model)
    assert total <= moved < total + 256 * KiB, (moved, total)

    # The secret key in no Event, status, Job or pod; the fill pod gets the Secret by
    # reference, as its environment, and the replicas not at all.
    secret_key = store.server.secret_key
    for what in ("events", f"dsvc/{NAME}", "jobs", "pods"):
        assert secret_key not in k8s.kubectl("-n", NS, "get", what, "-o", "json").stdout, what
    (job,) = fill_jobs(k8s).values()
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["args"] == ["fetch", source, "--model-cache", "/models", "--json-lines",
                                 "--result-file", "/dev/termination-log"]  # fmt: skip
    assert container["envFrom"] == [{"secretRef": {"name": SECRET}}]
    for pod in pods.values():
        assert SECRET not in json.dumps(pod["spec"])
    began, ended = (_time(job["status"][k]) for k in ("startTime", "completionTime"))
    shown = [c for i, c in enumerate(watch.columns) if i == 0 or c != watch.columns[i - 1]]
    seen.figures += [
        f"first fill: Job {ended - began:.0f} s (start to completion); Fetching seen "
        f"{fetched - (watch.fetching_since or fetched):.1f} s before ModelReady; apply to "
        f"ModelReady {fetched - applied:.1f} s",
        "MODEL column during it: " + " | ".join(shown),
        f"apply to Ready (2 replicas + router): {ready - applied:.1f} s",
        f"bytes through the proxy: {moved} for a model of {total} (+{moved - total})",
    ]


def test_a_new_source_fills_beside_the_old_then_rolls(
    k8s: NodeBackend, store: Store, seen: Seen
) -> None:
    old, new = store.source("tiny-v1"), store.source("tiny-v2")
    store.proxy.rate = HELD_RATE
    patched = time.monotonic()
    patch_source(k8s, new)

    def fetching() -> bool:
        fetch = (status(k8s).get("model") or {}).get("fetch") or {}
        return fetch.get("source") == new and fetch.get("state") == "Fetching"

    eventually(fetching, 120, "the second fill under way")
    st = status(k8s)
    assert st["model"]["loaded"]["source"] == old
    assert condition(st, "ModelReady")["reason"] == "Fetching"
    assert f"replicas load {old} meanwhile" in condition(st, "ModelReady")["message"]

    # A replica lost meanwhile comes back on the old entry, under its own name.
    lost = replica_pods(k8s)[f"{NAME}-replica-0"]["metadata"]["uid"]
    k8s.kubectl("-n", NS, "delete", "pod", f"{NAME}-replica-0", "--wait=false")
    waiting_reasons: set[str] = set()

    def back() -> dict[str, Any]:
        pod = replica_pods(k8s).get(f"{NAME}-replica-0")
        if pod is None or pod["metadata"]["uid"] == lost:
            return {}
        for cs in (pod.get("status") or {}).get("containerStatuses") or []:
            waiting_reasons.add(((cs.get("state") or {}).get("waiting") or {}).get("reason", ""))
        return pod if pod_ready(pod) else {}

    pod = eventually(back, 240, "replica 0 back and Ready")
    assert model_arg(pod) == seen.v1_path
    assert pod["status"]["containerStatuses"][0]["restartCount"] == 0
    assert "CrashLoopBackOff" not in waiting_reasons, waiting_reasons
    assert not job_finished(job_of(k8s, new), "Complete"), "the fill ended before the test"
    assert status(k8s)["model"]["loaded"]["source"] == old
    assert generate(k8s) == seen.v1_image

    # The fill released: loaded moves to the new entry and the replicas roll onto it.
    store.proxy.rate = None
    eventually(lambda: status(k8s)["model"]["loaded"]["source"] == new, 120, "v2 loaded")
    loaded = status(k8s)["model"]["loaded"]
    assert loaded["path"] != seen.v1_path
    assert len([e for e in events(k8s, "FetchFinished") if new in e["message"]]) == 1
    generation = k8s.get(NS, "dsvc", NAME)["metadata"]["generation"]

    def rolled() -> bool:
        pods = replica_pods(k8s).values()
        st = status(k8s)
        return (
            len(pods) == 2
            and all(pod_ready(p) and model_arg(p) == loaded["path"] for p in pods)
            and st.get("observedGeneration") == generation
            and st.get("updatedReplicas") == 2 == st.get("readyReplicas")
            and condition(st, "Ready").get("status") == "True"
        )

    eventually(rolled, 420, "the roll onto v2")
    seen.v2_path = loaded["path"]
    seen.v2_image = generate(k8s)
    assert seen.v2_image != seen.v1_image  # other weights, same request and seed
    seen.figures.append(f"new source to both replicas on it: {time.monotonic() - patched:.1f} s")


def test_a_corrupt_source_fails_at_once_and_the_replicas_keep_serving(
    k8s: NodeBackend, store: Store, seen: Seen, tiny_model: Path
) -> None:
    upload_folder(store.server.client(), store.bucket, "tiny-v3", tiny_model, sha256=True)
    on_disk = store.server.object_path(store.bucket, f"tiny-v3/{CORRUPT}")
    data = bytearray(on_disk.read_bytes())
    data[len(data) // 2] ^= 0xFF  # the same size: only the digest can tell
    on_disk.write_bytes(bytes(data))
    bad = store.source("tiny-v3")
    patch_source(k8s, bad)

    def failed() -> dict[str, Any]:
        ready = condition(status(k8s), "ModelReady")
        return ready if ready.get("reason") == "FetchFailed" else {}

    ready = eventually(failed, 180, "ModelReady FetchFailed")
    assert ready["status"] == "False" and CORRUPT in ready["message"], ready
    (warning,) = [e for e in events(k8s, "FetchFailed") if bad in e["message"]]
    assert warning["type"] == "Warning" and CORRUPT in warning["message"]
    # A refusal fails the Job through its podFailurePolicy: one pod, no retry.
    job = job_of(k8s, bad)
    assert job is not None and job_finished(job, "Failed")
    assert job["status"].get("failed") == 1
    failure = next(c for c in job["status"]["conditions"] if c["type"] == "Failed")
    assert failure["reason"] == "PodFailurePolicy", failure
    pods = k8s.get(NS, "pods", "-l", f"dpserve.dev/fill-job={job['metadata']['name']}")
    assert len(pods["items"]) == 1
    assert status(k8s)["model"]["progress"] == "Failed" and model_column(k8s) == "Failed"

    # The replicas stay on v2 and serve.
    st = status(k8s)
    assert st["model"]["loaded"]["path"] == seen.v2_path
    assert condition(st, "Ready")["status"] == "True" and st["readyReplicas"] == 2
    assert {model_arg(p) for p in replica_pods(k8s).values()} == {seen.v2_path}
    assert generate(k8s) == seen.v2_image


def test_delete_takes_the_fill_jobs_too(k8s: NodeBackend, seen: Seen) -> None:
    assert len(fill_jobs(k8s)) == 3  # v1, v2, v3: finished Jobs linger (their TTL)
    k8s.kubectl("-n", NS, "delete", "dsvc", NAME, "--wait=false")
    kinds = (
        "pods,services,deployments,jobs,serviceaccounts,roles,rolebindings,configmaps,"
        "secrets,networkpolicies,poddisruptionbudgets"
    )

    def leftovers() -> list[str]:
        listed = k8s.get(NS, kinds, "-l", f"app.kubernetes.io/instance={NAME}")["items"]
        return [f"{o['kind']}/{o['metadata']['name']}" for o in listed]

    eventually(lambda: leftovers() == [], 180, "garbage collection")
    print("\n".join(["", "model.source journey figures:", *seen.figures]))


# ------------------------------------------------------------------ a node-local cache

NODE_NAME = "tiny-node"


@pytest.fixture
def node_folder(k8s: NodeBackend, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh host folder for the node-local cache, writable by the pods' user, in a
    namespace whose Pod Security level admits hostPath volumes (restricted and baseline
    both refuse them; docs/models.md): "privileged" enforced, "restricted" still warned."""
    folder = tmp_path_factory.mktemp("node-cache")
    os.chown(folder, POD_USER, POD_USER)
    folder.chmod(0o755)
    labels = ["pod-security.kubernetes.io/enforce=privileged",
              "pod-security.kubernetes.io/warn=restricted"]  # fmt: skip
    k8s.kubectl("label", "ns", NS, "--overwrite", *labels)
    try:
        yield folder
    finally:
        k8s.kubectl("-n", NS, "delete", "dsvc", NODE_NAME, "--ignore-not-found",
                    "--timeout=120s", check=False)  # fmt: skip
        k8s.kubectl("label", "ns", NS, "--overwrite",
                    "pod-security.kubernetes.io/enforce=restricted",
                    "pod-security.kubernetes.io/warn-")  # fmt: skip


def test_a_node_local_cache_is_filled_once_for_two_replicas_on_the_node(
    k8s: NodeBackend,
    store: Store,
    credentials: str,
    node_folder: Path,
    seen: Seen,
    tiny_model: Path,
) -> None:
    source = store.source("tiny-v1")
    store.proxy.rate = FILL_RATE
    before = store.proxy.sent
    body = service(source)
    body["metadata"]["name"] = NODE_NAME
    body["spec"]["model"]["cache"] = {"nodeLocal": {"path": str(node_folder)}}
    applied = time.monotonic()
    k8s.kubectl("apply", "-f", "-", input=json.dumps(body))
    phases: set[str] = set()
    partial: list[dict[str, Any]] = []

    def serving() -> bool:
        st = k8s.get(NS, "dsvc", NODE_NAME).get("status") or {}
        phases.update(r["phase"] for r in st.get("replicaStatuses") or [])
        fetch = (st.get("model") or {}).get("fetch") or {}
        if fetch.get("state") == "Fetching" and fetch["bytesDone"] < fetch["bytesTotal"]:
            partial.append(fetch)
        return condition(st, "Ready").get("status") == "True"

    eventually(serving, 300, "the node-local service Ready", poll_s=0.5)
    ready = time.monotonic()
    image = generate(k8s, NODE_NAME)

    # Seen while it ran: a replica fetching in its init container, with progress.
    assert "FetchingModel" in phases, phases
    assert partial and all(f["pod"].startswith(f"{NODE_NAME}-replica-") for f in partial)
    st = k8s.get(NS, "dsvc", NODE_NAME)["status"]
    loaded = st["model"]["loaded"]
    assert loaded["nodeLocal"] == str(node_folder) and "claim" not in loaded
    assert condition(st, "ModelReady")["reason"] == "Fetched"
    assert st["readyReplicas"] == 2 and "fetch" not in st["model"]
    # The entry lies in the host folder, written by the pods' user.
    (index,) = node_folder.glob(f"entries/*/{loaded['revision']}/model/model_index.json")
    assert index.stat().st_uid == POD_USER
    pods = replica_pods(k8s, NODE_NAME)
    assert len(pods) == 2 and len({p["spec"]["nodeName"] for p in pods.values()}) == 1
    for pod in pods.values():
        assert model_arg(pod) == loaded["path"]
        (init,) = pod["spec"]["initContainers"]
        assert init["envFrom"] == [{"secretRef": {"name": SECRET}}]
        assert SECRET not in json.dumps(pod["spec"]["containers"])  # not the worker's
    if seen.v1_image:
        assert image == seen.v1_image  # the same weights as the claim's replicas served

    # One model's bytes through the proxy, though two pods fetched on the node.
    moved = store.proxy.sent - before
    total = model_bytes(tiny_model)
    assert total <= moved < total + 256 * KiB, (moved, total)
    secret_key = store.server.secret_key
    for what in ("events", f"dsvc/{NODE_NAME}", "pods", "jobs"):
        assert secret_key not in k8s.kubectl("-n", NS, "get", what, "-o", "json").stdout, what
    for reason in ("FetchStarted", "FetchPinned", "FetchFinished"):
        assert len(events(k8s, reason, NODE_NAME)) == 1, reason
    print(
        "\nnode-local cache figures:\n"
        f"apply to Ready (pin Job, 2 replicas fetching on one node, router): "
        f"{ready - applied:.1f} s\n"
        f"bytes through the proxy: {moved} for a model of {total} "
        f"(ratio {moved / total:.3f}, 2 replicas on one node)"
    )
