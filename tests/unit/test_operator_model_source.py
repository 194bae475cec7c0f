"""model.source on Kubernetes, on dicts: the fill Job's manifest, where the fetch stands
from what the operator read, and what replicas load meanwhile (docs/models.md)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from dpserve.operator import builders as b
from dpserve.operator import fill_job as f
from dpserve.operator.model_state import (
    FillFacts,
    model_step,
    needs_fill,
    previous_model,
    prune_due,
)
from dpserve.operator.spec import DiffusionServiceSpec, LoadedModel, ModelStatus, problems
from dpserve.operator.status import compute_status, known_indices

IMAGES = b.Images(worker="reg/dpserve-worker:1", router="reg/dpserve-router:1")
SOURCE = "s3://models/flux/"
MODEL = {
    "source": SOURCE,
    "credentials": {"secretName": "store"},
    "cache": {"claimName": "model-cache"},
}
FOLDER = "/models/entries/s3-models-flux/listing-abc/model"


def svc(model: dict[str, Any] | None = None, **spec: Any) -> b.Svc:
    body = {"model": model or MODEL, "replicas": 2, **spec}
    return b.Svc("flux", "ml", "uid-1", 3, DiffusionServiceSpec.model_validate(body))


def loaded(source: str = SOURCE, path: str = FOLDER, revision: str = "listing-abc") -> LoadedModel:
    return LoadedModel(source=source, revision=revision, path=path, claim="model-cache", bytes=10)


def job(*conditions: str) -> dict[str, Any]:
    return {
        "metadata": {"name": "flux-fill-x"},
        "status": {"conditions": [{"type": c, "status": "True"} for c in conditions]},
    }


def fill_pod(
    terminated: dict[str, Any] | None = None, waiting: dict[str, Any] | None = None
) -> dict[str, Any]:
    state = {"terminated": terminated} if terminated else {"waiting": waiting or {}}
    return {
        "metadata": {"name": "flux-fill-x-abc", "creationTimestamp": "2026-12-03T00:00:00Z"},
        "status": {
            "phase": "Running",
            "containerStatuses": [{"name": f.CONTAINER, "state": state}],
        },
    }


def result(**fields: Any) -> dict[str, Any]:
    return fill_pod(terminated={"exitCode": 0, "message": json.dumps(fields)})


# ------------------------------------------------------------ the spec


def test_a_source_needs_a_cache_and_excludes_path_and_volume() -> None:
    assert problems(svc().spec) == []
    with_path = svc({**MODEL, "path": "/models/x"}).spec
    assert any("exactly one of path" in p for p in problems(with_path))
    no_cache = svc({"source": SOURCE}).spec
    assert any("needs model.cache: claimName" in p for p in problems(no_cache))
    volume = {"persistentVolumeClaim": {"claimName": "m"}}
    both = svc({**MODEL, "volume": volume}).spec
    assert any("model.volume is for a model already on a volume" in p for p in problems(both))
    stray = svc({"path": "/models/x", "cache": {"claimName": "c"}}).spec
    assert any("go with model.source" in p for p in problems(stray))


@pytest.mark.parametrize(
    ("uri", "says"),
    [
        ("s3://KEY:SECRET@bucket/m", "credentials"),
        ("hf://only-one-part", "hf://ORG/NAME"),
    ],
)
def test_the_operator_refuses_what_dpserve_fetch_would(uri: str, says: str) -> None:
    found = problems(svc({**MODEL, "source": uri}).spec)
    assert len(found) == 1 and found[0].startswith("model.source: ") and says in found[0]


def test_the_crd_pattern_refuses_other_schemes() -> None:
    with pytest.raises(ValidationError, match="source"):
        svc({**MODEL, "source": "gs://bucket/m"})


# ------------------------------------------------------------ the fill Job


def test_the_fill_job_fetches_into_the_claim_with_the_secret_as_environment() -> None:
    job = f.build_fill_job(svc(env=[{"name": "HF_ENDPOINT", "value": "http://mirror"}]), IMAGES)
    assert job["kind"] == "Job" and job["metadata"]["name"] == f.fill_job_name(svc())
    spec = job["spec"]
    assert spec["backoffLimit"] == f.BACKOFF_LIMIT
    fail_fast = spec["podFailurePolicy"]["rules"][0]
    assert fail_fast["action"] == "FailJob" and fail_fast["onExitCodes"]["values"] == [3]
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never" and pod["automountServiceAccountToken"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True
    (container,) = pod["containers"]
    assert container["image"] == IMAGES.worker
    assert container["args"] == [
        "fetch", SOURCE, "--model-cache", "/models", "--json-lines",
        "--result-file", "/dev/termination-log",
    ]  # fmt: skip
    assert container["envFrom"] == [{"secretRef": {"name": "store"}}]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["HF_HUB_OFFLINE"] == "0" and env["HF_ENDPOINT"] == "http://mirror"
    assert "nvidia.com/gpu" not in json.dumps(container["resources"])
    mount = next(m for m in container["volumeMounts"] if m["name"] == "cache")
    assert mount == {"name": "cache", "mountPath": "/models"}  # read-write
    claim = next(v for v in pod["volumes"] if v["name"] == "cache")
    assert claim["persistentVolumeClaim"] == {"claimName": "model-cache"}
    labels = spec["template"]["metadata"]["labels"]
    assert labels[f.JOB_LABEL] == job["metadata"]["name"]
    assert labels["app.kubernetes.io/managed-by"] == "dpserve-operator"  # the operator watches it


def test_each_source_and_claim_gets_its_own_job() -> None:
    names = {
        f.fill_job_name(svc(m))
        for m in (
            MODEL,
            {**MODEL, "source": "s3://models/flux-v2/"},
            {**MODEL, "cache": {"claimName": "other"}},
        )
    }
    assert len(names) == 3 and all(len(n) <= 63 for n in names)


def test_replicas_mount_the_claim_read_only_and_load_the_fetched_folder() -> None:
    ready = b.Svc(**{**svc().__dict__, "fetched_path": FOLDER})
    pod = b.build_replica_pod(ready, 0, IMAGES)
    (container,) = pod["spec"]["containers"]
    args = container["args"]
    assert args[args.index("--model") + 1] == FOLDER
    mount = next(m for m in container["volumeMounts"] if m["name"] == "model")
    assert mount == {"name": "model", "mountPath": "/models", "readOnly": True}
    claim = next(v for v in pod["spec"]["volumes"] if v["name"] == "model")
    assert claim["persistentVolumeClaim"] == {"claimName": "model-cache", "readOnly": True}
    assert "envFrom" not in container  # the store's credentials are the fill Job's only


def test_the_fetched_folder_not_the_source_decides_a_roll() -> None:
    one = svc()
    moved = svc({**MODEL, "source": "s3://models/flux-v2/"})
    assert b.spec_hash(one.spec, FOLDER) == b.spec_hash(moved.spec, FOLDER)
    assert b.spec_hash(one.spec, FOLDER) != b.spec_hash(one.spec, FOLDER.replace("abc", "def"))


def test_a_spec_without_source_hashes_as_before_sources_existed() -> None:
    # The hash of a path-only spec as an operator without model sources computed it: an
    # upgrade must not roll every replica.
    spec = DiffusionServiceSpec.model_validate({"model": {"path": "/models/qwen"}})
    dumped = spec.model_dump(mode="json", exclude={"replicas", "router", "updateStrategy"})
    assert set(dumped["model"]) >= {"source", "cache", "credentials"}
    for key in ("source", "cache", "credentials"):
        del dumped["model"][key]
    # Fields added later hash as absent at their defaults too (adapter cache, placement).
    for key in ("loraCacheMb", "topologySpreadConstraints", "onePerNode", "priorityClassName"):
        del dumped[key]
    import hashlib

    old = {"spec": dumped, "shape": b.POD_SHAPE}
    digest = hashlib.sha256(json.dumps(old, sort_keys=True).encode()).hexdigest()[:16]
    assert b.spec_hash(spec) == digest


# ------------------------------------------------------------ where the fetch stands


def test_without_a_source_the_model_is_in_place() -> None:
    plain = b.Svc("x", "ml", "u", 1, DiffusionServiceSpec.model_validate({"model": {"path": "/m"}}))
    step = model_step(plain, None, FillFacts())
    assert step.fetched_path == "/m" and step.status is None and step.condition[0] == "True"
    assert not needs_fill(plain, None)


def test_a_new_source_starts_its_job_and_holds_the_replicas() -> None:
    step = model_step(svc(), None, FillFacts())
    assert step.create_job and step.fetched_path is None
    assert step.status is not None and step.status.fetch is not None
    assert step.status.fetch.state == "Pending" and step.status.progress == "Pending"
    assert step.condition[:2] == ("False", "FetchPending")


def test_progress_comes_from_the_newest_progress_line_of_the_log() -> None:
    line = {
        "event": "progress", "revision": "listing-abc", "state": "fetching",
        "bytes_done": 41, "bytes_total": 100, "rate_bytes_per_s": 2_000_000, "eta_s": 29.5,
    }  # fmt: skip
    tail = "\n".join(
        [
            json.dumps({**line, "bytes_done": 10}),
            json.dumps(line),
            "2026-12-03 dpserve.sources fetching s3://models/flux/: 41% ...",  # stderr
        ]
    )
    step = model_step(svc(), None, FillFacts(job=job(), pod=fill_pod(), log_tail=tail))
    assert step.status is not None and step.status.fetch is not None
    fetch = step.status.fetch
    assert (fetch.state, fetch.bytesDone, fetch.bytesTotal) == ("Fetching", 41, 100)
    assert (fetch.bytesPerSecond, fetch.etaSeconds, fetch.revision) == (
        2_000_000,
        29,
        "listing-abc",
    )
    assert step.status.progress == "Fetching 41% (41 B of 100 B), 2.0 MB/s, 0m29s left"
    assert step.condition[:2] == ("False", "Fetching")
    assert not step.create_job and step.fetched_path is None


def test_a_fill_pod_that_cannot_start_says_why() -> None:
    waiting = {"reason": "CreateContainerConfigError", "message": 'secret "store" not found'}
    step = model_step(svc(), None, FillFacts(job=job(), pod=fill_pod(waiting=waiting)))
    assert step.status is not None and step.status.fetch is not None
    assert step.status.fetch.state == "Pending"
    assert 'secret "store" not found' in step.condition[2]


def test_a_completed_job_loads_the_folder_it_published() -> None:
    pod = result(state="ready", source=SOURCE, revision="listing-abc", folder=FOLDER, bytes_total=7)
    step = model_step(svc(), None, FillFacts(job=job("Complete"), pod=pod))
    assert step.fetched_path == FOLDER
    assert step.status is not None and step.status.loaded is not None
    assert step.status.loaded.revision == "listing-abc" and step.status.loaded.bytes == 7
    assert step.status.fetch is None and step.status.progress == "Ready"
    assert [n.reason for _, n in step.notes] == ["FetchFinished"]
    # Recorded, it needs no Job read again, and no second Event.
    again = model_step(svc(), step.status, FillFacts())
    assert again.fetched_path == FOLDER and again.notes == [] and not again.create_job
    assert not needs_fill(svc(), step.status)


def test_a_fill_pod_that_exited_0_loads_its_folder_before_the_job_is_marked() -> None:
    """The Job controller marks the Job Complete a moment after its pod ends, and no
    event tells the operator: meanwhile the fill is done, not Pending."""
    pod = result(state="ready", source=SOURCE, revision="listing-abc", folder=FOLDER)
    step = model_step(svc(), None, FillFacts(job=job(), pod=pod))
    assert step.fetched_path == FOLDER and step.status is not None
    assert step.status.progress == "Ready" and step.condition[:2] == ("True", "Fetched")
    assert [n.reason for _, n in step.notes] == ["FetchFinished"]
    # A pod that failed with an outcome (its error) waits for the Job's verdict.
    failed = fill_pod(
        terminated={"exitCode": 1, "message": json.dumps({"state": "failed", "error": "x"})}
    )
    running = model_step(svc(), None, FillFacts(job=job(), pod=failed))
    assert running.fetched_path is None and running.condition[0] == "False"


def test_a_completed_job_whose_outcome_is_gone_is_made_again() -> None:
    step = model_step(svc(), None, FillFacts(job=job("Complete"), pod=None))
    assert step.delete_job and step.fetched_path is None


def test_a_refused_fetch_names_the_file_and_tells_once() -> None:
    error = "s3://models/flux/vae/x.safetensors: sha256 is 12, the store says 34"
    pod = fill_pod(
        terminated={"exitCode": 3, "message": json.dumps({"state": "failed", "error": error})}
    )
    step = model_step(svc(), None, FillFacts(job=job("Failed"), pod=pod))
    assert step.condition[:2] == ("False", "FetchFailed") and error in step.condition[2]
    assert step.status is not None and step.status.fetch is not None
    assert step.status.fetch.state == "Failed" and step.status.fetch.message == error
    assert [(k, n.reason) for k, n in step.notes] == [("Warning", "FetchFailed")]
    again = model_step(svc(), step.status, FillFacts(job=job("Failed"), pod=pod))
    assert again.notes == []


def test_a_new_source_keeps_replicas_on_the_old_entry_until_it_is_fetched() -> None:
    before = ModelStatus(loaded=loaded(), progress="Ready")
    moved = svc({**MODEL, "source": "s3://models/flux-v2/"})
    assert needs_fill(moved, before)
    step = model_step(moved, before, FillFacts())
    assert step.create_job and step.fetched_path == FOLDER  # the old entry, meanwhile
    assert "replicas load s3://models/flux/ meanwhile" in step.condition[2]
    new_folder = "/models/entries/s3-models-flux-v2/listing-def/model"
    pod = result(state="ready", revision="listing-def", folder=new_folder, bytes_total=9)
    done = model_step(moved, step.status, FillFacts(job=job("Complete"), pod=pod))
    assert done.fetched_path == new_folder


def test_an_unreadable_status_model_counts_as_none() -> None:
    assert previous_model({"model": {"loaded": {"source": 3}}}) is None
    assert previous_model({}) is None


def test_status_shows_replicas_waiting_for_their_model() -> None:
    service = svc()
    step = model_step(service, None, FillFacts())
    status = compute_status(service, [], {}, model=step)
    assert [r["phase"] for r in status["replicaStatuses"]] == ["WaitingForModel"] * 2
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["Ready"]["reason"] == "WaitingForModel"
    assert conditions["ModelReady"]["status"] == "False"
    assert status["model"]["progress"] == "Pending"
    assert known_indices(status) == set()  # listed, never made: their creation is new


# ------------------------------------------------------------ the clean-up after a roll


def test_the_prune_job_spares_every_loaded_folder_and_keeps_the_newest() -> None:
    service = svc({**MODEL, "cache": {"claimName": "model-cache", "keep": 2}})
    other = "/models/entries/s3-team-b/listing-9/model"
    job = f.build_prune_job(service, IMAGES, FOLDER, [other, FOLDER])
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["args"] == [
        "prune-cache", "--model-cache", "/models", "--keep", "2",
        "--protect", FOLDER, "--protect", other,
    ]  # fmt: skip
    assert "envFrom" not in container  # no credentials: it reads only the claim
    assert job["metadata"]["name"] == f.prune_job_name(service, FOLDER)
    assert f.prune_job_name(service, FOLDER) != f.prune_job_name(service, other)


def test_the_cache_is_pruned_once_the_replicas_rolled_onto_the_loaded_entry() -> None:
    service = svc()
    before = ModelStatus(loaded=loaded(), progress="Ready")
    step = model_step(service, before, FillFacts())
    entries = [{"index": i} for i in range(2)]
    rolled = {"updatedReplicas": 2, "readyReplicas": 2, "replicaStatuses": entries}
    assert prune_due(service, step, rolled) == FOLDER
    assert prune_due(service, step, {**rolled, "readyReplicas": 1}) is None
    assert prune_due(service, step, {**rolled, "replicaStatuses": [*entries, {"index": 0}]}) is None
    done = ModelStatus(loaded=loaded(), progress="Ready", pruned=FOLDER)
    again = model_step(service, done, FillFacts())
    assert again.status is not None and again.status.pruned == FOLDER  # kept across steps
    assert prune_due(service, again, rolled) is None
    # While a new source is fetched, the replicas run the old entry: not yet.
    moved = svc({**MODEL, "source": "s3://models/flux-v2/"})
    assert prune_due(moved, model_step(moved, before, FillFacts()), rolled) is None
