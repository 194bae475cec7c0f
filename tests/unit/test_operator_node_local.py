"""model.cache.nodeLocal on dicts: the pin Job, the replicas' init container and
mounts, and where the nodes' fetches stand from what the operator read of the replica
pods (docs/models.md, Node-local caches)."""

from __future__ import annotations

import json
from typing import Any

from dpserve.operator import builders as b
from dpserve.operator import fill_job as f
from dpserve.operator.model_state import (
    FillFacts,
    fetching_now,
    model_step,
    needs_fill,
    node_step,
    prune_due,
)
from dpserve.operator.spec import (
    CACHE_ONE_OF,
    NODE_LOCAL_REFUSED,
    DiffusionServiceSpec,
    LoadedModel,
    ModelFetch,
    ModelStatus,
    problems,
)
from dpserve.operator.status import compute_status, pod_facts

IMAGES = b.Images(worker="reg/dpserve-worker:1", router="reg/dpserve-router:1")
COMMIT = "0123456789abcdef0123456789abcdef01234567"
SOURCE = "hf://org/tiny@main"
HOST = "/var/lib/dpserve/models"
MODEL = {
    "source": SOURCE,
    "credentials": {"secretName": "store"},
    "cache": {"nodeLocal": {"path": HOST}, "keep": 2},
}
FOLDER = f"/models/hf/models--org--tiny/snapshots/{COMMIT}"
PINNED = {"state": "pinned", "source": SOURCE, "revision": COMMIT, "folder": FOLDER,
          "fetch": f"hf://org/tiny@{COMMIT}", "bytes_total": 4800000, "files": 9}  # fmt: skip


def svc(model: dict[str, Any] | None = None, replicas: int = 2) -> b.Svc:
    body = {"model": model or MODEL, "replicas": replicas}
    return b.Svc("tiny", "ml", "uid-1", 3, DiffusionServiceSpec.model_validate(body))


def pinned_status() -> ModelStatus:
    loaded = LoadedModel(source=SOURCE, revision=COMMIT, path=FOLDER, nodeLocal=HOST, bytes=10)
    return ModelStatus(loaded=loaded, progress="Ready")


def pin_pod(code: int, outcome: dict[str, Any]) -> dict[str, Any]:
    terminated = {"exitCode": code, "message": json.dumps(outcome)}
    state = {"name": "fetch", "state": {"terminated": terminated}}
    return {"metadata": {"name": "tiny-pin-x-1"}, "status": {"containerStatuses": [state]}}


def ready_svc(previous: ModelStatus | None = None) -> tuple[b.Svc, Any]:
    """The service once pinned, with the step the operator computed."""
    service = svc()
    step = model_step(service, previous or pinned_status(), FillFacts())
    return b.Svc(**{**service.__dict__, "fetched_path": step.fetched_path,
                    "node_fetch": step.node_fetch}), step  # fmt: skip


def replica(service: b.Svc, index: int, init: dict[str, Any] | None, phase: str = "Pending",
            last: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    """A replica pod on the current spec whose fetch init container is in ``init``."""
    pod = b.build_replica_pod(service, index, IMAGES)
    statuses = [{"name": "fetch", "state": init, **({"lastState": last} if last else {})}]
    pod["status"] = {"phase": phase, "initContainerStatuses": statuses if init else []}
    return pod


def progress_log(done: int, total: int) -> str:
    line = {"event": "progress", "revision": COMMIT, "bytes_done": done, "bytes_total": total,
            "rate_bytes_per_s": 1000, "eta_s": 5}  # fmt: skip
    return "log line on stderr\n" + json.dumps(line) + "\n"


# ------------------------------------------------------------ the spec


def test_a_cache_is_a_claim_or_a_node_folder_not_both_nor_neither() -> None:
    both = {**MODEL, "cache": {"nodeLocal": {"path": HOST}, "claimName": "c"}}
    assert CACHE_ONE_OF in problems(svc(both).spec, allow_host_path=True)
    assert CACHE_ONE_OF in problems(svc({**MODEL, "cache": {}}).spec, allow_host_path=True)
    assert problems(svc().spec, allow_host_path=True) == []


def test_a_node_local_cache_needs_the_operators_host_path_switch() -> None:
    assert problems(svc().spec) == [NODE_LOCAL_REFUSED]
    assert "allowHostPathModels" in NODE_LOCAL_REFUSED


# ------------------------------------------------------------ the pin Job


def test_the_pin_job_resolves_the_revision_and_mounts_no_cache() -> None:
    job = f.build_fill_job(svc(), IMAGES)
    assert job["metadata"]["name"].startswith("tiny-pin-")
    assert job["metadata"]["labels"]["app.kubernetes.io/component"] == f.COMPONENT  # watched
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["args"] == ["fetch", SOURCE, "--model-cache", "/models", "--pin",
                                 "--result-file", "/dev/termination-log"]  # fmt: skip
    assert container["envFrom"] == [{"secretRef": {"name": "store"}}]
    assert [v["name"] for v in pod["volumes"]] == ["scratch"]  # no hostPath in the Job
    assert job["spec"]["podFailurePolicy"]["rules"][0]["onExitCodes"]["values"] == [3]
    claim = svc({**MODEL, "cache": {"claimName": "c"}})
    assert f.fill_job_name(claim) != f.fill_job_name(svc())


def test_a_pin_loads_at_once_and_tells_what_each_node_fetches() -> None:
    service = svc()
    assert needs_fill(service, None)
    step = model_step(service, None, FillFacts(job={"status": {}}, pod=pin_pod(0, PINNED)))
    assert step.fetched_path == FOLDER
    assert step.status is not None and step.status.loaded is not None
    loaded = step.status.loaded
    assert (loaded.nodeLocal, loaded.claim, loaded.revision) == (HOST, None, COMMIT)
    # The hub source pinned to its commit, so every node fetches the same files.
    assert step.node_fetch == b.NodeFetch(uri=f"hf://org/tiny@{COMMIT}", revision=COMMIT)
    assert [n.reason for _, n in step.notes] == ["FetchPinned"]
    assert not needs_fill(service, step.status)
    # A claim's step has no init container to run.
    claim = svc({**MODEL, "cache": {"claimName": "c"}})
    assert model_step(claim, None, FillFacts()).node_fetch is None


def test_a_failed_pin_holds_the_replicas_and_says_why() -> None:
    failed = {"state": "failed", "error": "hf://org/tiny@main: no such repository"}
    job = {"status": {"conditions": [{"type": "Failed", "status": "True"}]}}
    step = model_step(svc(), None, FillFacts(job=job, pod=pin_pod(3, failed)))
    assert step.fetched_path is None and step.node_fetch is None
    assert step.condition[1] == "FetchFailed" and "no such repository" in step.condition[2]


# ------------------------------------------------------------ the replicas


def test_each_replica_fetches_the_pinned_revision_in_an_init_container() -> None:
    service, _ = ready_svc()
    pod = b.build_replica_pod(service, 0, IMAGES)["spec"]
    (init,) = pod["initContainers"]
    assert init["name"] == "fetch" and init["image"] == IMAGES.worker
    assert init["args"] == [
        "fetch", f"hf://org/tiny@{COMMIT}", "--model-cache", "/models", "--json-lines",
        "--result-file", "/dev/termination-log", "--expect-revision", COMMIT,
        "--prune-keep", "2",
    ]  # fmt: skip
    assert init["securityContext"] == b.container_security()
    assert init["terminationMessagePath"] == "/dev/termination-log"
    # The Secret goes to the init container only; the worker reads the node's folder.
    assert init["envFrom"] == [{"secretRef": {"name": "store"}}]
    (worker,) = pod["containers"]
    assert "store" not in json.dumps(worker)
    assert worker["args"][worker["args"].index("--model") + 1] == FOLDER
    init_mount = next(m for m in init["volumeMounts"] if m["name"] == "model")
    assert init_mount == {"name": "model", "mountPath": "/models"}  # read-write
    mount = next(m for m in worker["volumeMounts"] if m["name"] == "model")
    assert mount == {"name": "model", "mountPath": "/models", "readOnly": True}
    volume = next(v for v in pod["volumes"] if v["name"] == "model")
    assert volume == {"name": "model", "hostPath": {"path": HOST, "type": "Directory"}}
    env = {e["name"]: e.get("value") for e in init["env"]}
    assert env["HF_HUB_OFFLINE"] == "0"


def test_a_new_pin_rolls_the_replicas() -> None:
    one, _ = ready_svc()
    other = pinned_status()
    assert other.loaded is not None
    other.loaded = other.loaded.model_copy(update={"revision": "f" * 40, "path": "/models/x"})
    two, _ = ready_svc(other)
    assert one.pod_hash != two.pod_hash
    assert b.build_replica_pod(two, 0, IMAGES)["spec"]["initContainers"][0]["args"][1] == (
        f"hf://org/tiny@{'f' * 40}"
    )


def test_a_claims_pods_hash_as_before_node_local_caches_existed() -> None:
    """An upgrade of the operator rolls no claim-fed replica: the hash (computed by the
    operator before nodeLocal existed) is the same."""
    claim = svc({"source": "s3://models/flux/", "cache": {"claimName": "c", "keep": 2}}).spec
    assert b.spec_hash(claim, "/models/entries/x/model") == "0bf267e756080e2f"


# ------------------------------------------------------------ the nodes' fetches


def test_modelready_says_fetching_until_every_replica_is_past_its_fetch() -> None:
    service, step = ready_svc()
    was = ModelStatus(
        loaded=pinned_status().loaded, fetch=ModelFetch(source=SOURCE, state="Pending")
    )
    pods = [
        replica(service, 0, {"running": {}}),
        replica(service, 1, {"waiting": {"reason": "PodInitializing"}}),
    ]
    assert fetching_now(service, pods) == ["tiny-replica-0"]
    tails = {"tiny-replica-0": progress_log(1200000, 4800000)}
    now = node_step(service, step, was, pods, tails)
    assert now.condition[:2] == ("False", "Fetching")
    assert "tiny-replica-0" in now.condition[2] and "0/2 replicas fetched" in now.condition[2]
    assert now.status is not None and now.status.fetch is not None
    assert (now.status.fetch.pod, now.status.fetch.bytesDone) == ("tiny-replica-0", 1200000)
    assert now.status.progress.startswith("Fetching 25% (1.2 MB of 4.8 MB)")
    assert now.fetched_path == FOLDER  # replicas are made: each waits in its init container
    status = compute_status(service, pods, {}, model=now)
    assert [r["phase"] for r in status["replicaStatuses"]] == ["FetchingModel"] * 2
    assert status["model"]["fetch"]["pod"] == "tiny-replica-0"

    # One done and serving, the other exited 0 a moment ago: Fetched, told once.
    done = {"terminated": {"exitCode": 0, "message": json.dumps({"state": "ready"})}}
    pods = [replica(service, 0, done, "Running"), replica(service, 1, done)]
    finished = node_step(service, step, was, pods, {})
    assert finished.condition[:2] == ("True", "Fetched")
    assert finished.status is not None and finished.status.fetch is None
    assert finished.status.progress == "Ready"
    assert [n.reason for _, n in finished.notes] == ["FetchFinished"]
    assert node_step(service, step, finished.status, pods, {}).notes == []
    # A replica not made yet (a roll replaces them in turn) has not fetched.
    assert node_step(service, step, was, pods[:1], {}).condition[1] == "FetchPending"


def test_a_refused_fetch_on_a_node_names_the_file_and_tells_once() -> None:
    service, step = ready_svc()
    error = f"hf://org/tiny@{COMMIT}: vae/x.safetensors: sha256 is 12, the hub says 34"
    refused = {"exitCode": 3, "message": json.dumps({"state": "failed", "error": error,
                                                     "retried": False})}  # fmt: skip
    pods = [
        replica(
            service, 0, {"waiting": {"reason": "CrashLoopBackOff"}}, last={"terminated": refused}
        ),
        replica(service, 1, {"running": {}}),
    ]
    now = node_step(service, step, None, pods, {})
    assert now.condition[:2] == ("False", "FetchFailed")
    assert "tiny-replica-0" in now.condition[2] and "vae/x.safetensors" in now.condition[2]
    assert now.status is not None and now.status.progress == "Failed"
    ((kind, note),) = now.notes
    assert kind == "Warning" and note.reason == "FetchFailed" and error in note.message
    assert node_step(service, step, now.status, pods, {}).notes == []
    facts = pod_facts(pods[0])
    assert facts.reason == "CrashLoopBackOff" and "vae/x.safetensors" in (facts.message or "")
    # A failure that may pass shows as waiting to try again, not as failed.
    transient = {"exitCode": 1, "message": json.dumps({"state": "failed", "error": "timeout",
                                                       "retried": True})}  # fmt: skip
    pods[0] = replica(service, 0, {"waiting": {"reason": "CrashLoopBackOff"}},
                      last={"terminated": transient})  # fmt: skip
    again = node_step(service, step, None, pods, {})
    assert again.condition[1] == "FetchPending" and "tries again: timeout" in again.condition[2]


def test_a_node_local_cache_has_no_prune_job() -> None:
    service, step = ready_svc()
    rolled = {"updatedReplicas": 2, "readyReplicas": 2, "replicaStatuses": [{}, {}]}
    assert prune_due(service, step, rolled) is None
