"""The model cache's Jobs (docs/models.md, On Kubernetes): the fill, ``dpserve fetch`` of
model.source into the claim once for every replica, and the prune after a roll,
``dpserve prune-cache``; with a node-local cache, the pin, ``dpserve fetch --pin``: the
revision every node's replicas then fetch. Pure builders, like ``builders``.

One Job per source and claim (its name hashes both), so a new source is a new Job
and the old one's outcome stays readable until it expires. The pod reports on two
channels the operator reads without any access to the volume: JSON progress lines
on stdout (the last one, through the pod's log) and the outcome in its termination
message (``--result-file /dev/termination-log``).
"""

from __future__ import annotations

import hashlib
from typing import Any, Final

from dpserve.operator import builders as b
from dpserve.sources.errors import EXIT_REFUSED

COMPONENT: Final = "model-fill"
PRUNE_COMPONENT: Final = "model-prune"
CONTAINER: Final = b.FETCH_CONTAINER
SOURCE_ANNOTATION: Final = "dpserve.dev/model-source"
JOB_LABEL: Final = "dpserve.dev/fill-job"  # on the Job's pods: the operator lists them by it
TERMINATION_LOG: Final = b.TERMINATION_LOG
# Tries of a fetch that failed for a reason that may pass (the store unreachable, a
# pod lost); each resumes where the last stopped. A refusal (exit EXIT_REFUSED: a
# digest that does not match, not a pipeline) fails the Job at once.
BACKOFF_LIMIT: Final = 4
# A finished Job lingers this long, so its outcome can be read, then goes; status
# keeps what the replicas need (the loaded entry), and a Job made again for a ready
# entry only confirms it (nothing is moved).
TTL_AFTER_FINISHED_S: Final = 24 * 3600


def fill_job_name(svc: b.Svc) -> str:
    """``<name>-fill-<hash>`` into a claim, ``<name>-pin-<hash>`` for a node-local cache."""
    model = svc.spec.model
    assert model.source is not None and model.cache is not None
    node = model.cache.nodeLocal
    where = f"node:{node.path}" if node is not None else model.cache.claimName
    key = f"{model.source}\0{where}\0{model.mountPath}"
    kind = "pin" if node is not None else "fill"
    return f"{svc.name}-{kind}-{hashlib.sha256(key.encode()).hexdigest()[:10]}"


def pods_selector(job_name: str) -> str:
    return f"{JOB_LABEL}={job_name}"


def fill_args(svc: b.Svc) -> list[str]:
    """Into the claim; or, node-local, only the pin: nothing fetched, no volume, the
    folder named as the replicas will see it under mountPath."""
    model = svc.spec.model
    assert model.source is not None and model.cache is not None
    pin = ["--pin"] if model.cache.nodeLocal is not None else ["--json-lines"]
    return ["fetch", model.source, "--model-cache", model.mountPath, *pin,
            "--result-file", TERMINATION_LOG]  # fmt: skip


def build_fill_job(svc: b.Svc, images: b.Images) -> dict[str, Any]:
    """The fill Job (the pin Job, node-local): the Secret's keys become variables of its
    pod only, never arguments, never the replicas' (they read the cache, not the store)."""
    model = svc.spec.model
    assert model.source is not None and model.cache is not None
    scratch, scratch_mount = b.scratch_volume()
    if model.cache.nodeLocal is not None:
        volumes, mounts = [scratch], [scratch_mount]
    else:
        volumes, mounts = _claim_volume(svc, scratch, scratch_mount)
    container = b.fetch_container(svc.spec, images, fill_args(svc), mounts)
    job = _job(svc, images, fill_job_name(svc), COMPONENT, container, volumes)
    job["metadata"]["annotations"] = {SOURCE_ANNOTATION: model.source}
    pod = job["spec"]["template"]
    pod["metadata"]["annotations"] = {SOURCE_ANNOTATION: model.source}
    job["spec"]["backoffLimit"] = BACKOFF_LIMIT
    job["spec"]["podFailurePolicy"] = {
        "rules": [
            {
                "action": "FailJob",
                "onExitCodes": {
                    "containerName": CONTAINER,
                    "operator": "In",
                    "values": [EXIT_REFUSED],
                },
            },
            # A pod evicted or preempted is no failed try: the next resumes.
            {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]},
        ]
    }
    return job


def prune_job_name(svc: b.Svc, loaded: str) -> str:
    return f"{svc.name}-prune-{hashlib.sha256(loaded.encode()).hexdigest()[:10]}"


def build_prune_job(
    svc: b.Svc, images: b.Images, loaded: str, protect: list[str]
) -> dict[str, Any]:
    """``dpserve prune-cache`` after the replicas rolled onto ``loaded``: ``protect`` is
    every folder a DiffusionService of the namespace loads from the claim."""
    model = svc.spec.model
    assert model.cache is not None
    args = ["prune-cache", "--model-cache", model.mountPath, "--keep", str(model.cache.keep)]
    for folder in sorted({loaded, *protect}):
        args += ["--protect", folder]
    volumes, mounts = _claim_volume(svc, *b.scratch_volume())
    container = {
        **b.fetch_container(svc.spec, images, args, mounts),
        "env": b.scratch_env(),  # nor the hub's switches: it reads the claim only
    }
    container.pop("envFrom", None)
    job = _job(svc, images, prune_job_name(svc, loaded), PRUNE_COMPONENT, container, volumes)
    job["spec"]["backoffLimit"] = 2
    return job


def _claim_volume(
    svc: b.Svc, scratch: dict[str, Any], scratch_mount: dict[str, Any]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The cache claim mounted read-write at mountPath, and the scratch folder."""
    model = svc.spec.model
    assert model.cache is not None and model.cache.claimName is not None
    claim = {"name": "cache", "persistentVolumeClaim": {"claimName": model.cache.claimName}}
    return [claim, scratch], [{"name": "cache", "mountPath": model.mountPath}, scratch_mount]


def _job(
    svc: b.Svc,
    images: b.Images,
    name: str,
    component: str,
    container: dict[str, Any],
    volumes: list[dict[str, Any]],
) -> dict[str, Any]:
    """A Job of one ``dpserve`` pod."""
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": b.child_meta(svc, name, component),
        "spec": {
            "ttlSecondsAfterFinished": TTL_AFTER_FINISHED_S,
            "template": {
                "metadata": {"labels": {**b.labels(svc, component), JOB_LABEL: name}},
                "spec": {
                    "restartPolicy": "Never",  # podFailurePolicy needs it
                    "containers": [container],
                    "volumes": volumes,
                    "securityContext": b.pod_security(),
                    "automountServiceAccountToken": False,
                    "enableServiceLinks": False,
                    **images.secrets(),
                },
            },
        },
    }
