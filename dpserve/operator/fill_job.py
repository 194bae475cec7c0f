"""The cache claim's Jobs (docs/models.md, On Kubernetes): the fill, ``dpserve fetch`` of
model.source into the claim once for every replica, and the prune after a roll,
``dpserve prune-cache``. Pure builders, like ``builders``.

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
CONTAINER: Final = "fetch"
SOURCE_ANNOTATION: Final = "dpserve.dev/model-source"
JOB_LABEL: Final = "dpserve.dev/fill-job"  # on the Job's pods: the operator lists them by it
TERMINATION_LOG: Final = "/dev/termination-log"
# Tries of a fetch that failed for a reason that may pass (the store unreachable, a
# pod lost); each resumes where the last stopped. A refusal (exit EXIT_REFUSED: a
# digest that does not match, not a pipeline) fails the Job at once.
BACKOFF_LIMIT: Final = 4
# A finished Job lingers this long, so its outcome can be read, then goes; status
# keeps what the replicas need (the loaded entry), and a Job made again for a ready
# entry only confirms it (nothing is moved).
TTL_AFTER_FINISHED_S: Final = 24 * 3600


def fill_job_name(svc: b.Svc) -> str:
    model = svc.spec.model
    assert model.source is not None and model.cache is not None
    key = f"{model.source}\0{model.cache.claimName}\0{model.mountPath}"
    return f"{svc.name}-fill-{hashlib.sha256(key.encode()).hexdigest()[:10]}"


def pods_selector(job_name: str) -> str:
    return f"{JOB_LABEL}={job_name}"


def fill_args(svc: b.Svc) -> list[str]:
    model = svc.spec.model
    assert model.source is not None
    return [
        "fetch",
        model.source,
        "--model-cache",
        model.mountPath,
        "--json-lines",
        "--result-file",
        TERMINATION_LOG,
    ]


def fill_env(svc: b.Svc) -> list[dict[str, Any]]:
    """The scratch variables, the hub switched back online (the worker image sets it
    offline for replicas) without its bars in the log, then the user's variables."""
    return [
        *b.scratch_env(),
        {"name": "HF_HUB_OFFLINE", "value": "0"},
        {"name": "HF_HUB_DISABLE_PROGRESS_BARS", "value": "1"},
        *(e.model_dump(exclude_none=True) for e in svc.spec.env or []),
    ]


def build_fill_job(svc: b.Svc, images: b.Images) -> dict[str, Any]:
    model = svc.spec.model
    assert model.source is not None
    job = _cache_job(svc, images, fill_job_name(svc), COMPONENT, fill_args(svc), fill_env(svc))
    job["metadata"]["annotations"] = {SOURCE_ANNOTATION: model.source}
    pod = job["spec"]["template"]
    pod["metadata"]["annotations"] = {SOURCE_ANNOTATION: model.source}
    if model.credentials is not None:
        # The Secret's keys become variables of this pod only: never arguments, never
        # the replicas' (they read the claim, not the store).
        secret = {"secretRef": {"name": model.credentials.secretName}}
        pod["spec"]["containers"][0]["envFrom"] = [secret]
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
    job = _cache_job(
        svc, images, prune_job_name(svc, loaded), PRUNE_COMPONENT, args, b.scratch_env()
    )
    job["spec"]["backoffLimit"] = 2
    return job


def _cache_job(
    svc: b.Svc,
    images: b.Images,
    name: str,
    component: str,
    args: list[str],
    env: list[dict[str, Any]],
) -> dict[str, Any]:
    """A Job of one ``dpserve`` pod with the claim mounted read-write at mountPath."""
    spec, model = svc.spec, svc.spec.model
    assert model.cache is not None
    scratch, scratch_mount = b.scratch_volume()
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": spec.image or images.worker,
        "imagePullPolicy": images.pull_policy,
        "command": ["dpserve"],
        "args": args,
        "env": env,
        "volumeMounts": [{"name": "cache", "mountPath": model.mountPath}, scratch_mount],
        "resources": {"requests": {"cpu": "500m", "memory": "512Mi"}},
        "terminationMessagePath": TERMINATION_LOG,
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": b.container_security(),
    }
    claim = {"claimName": model.cache.claimName}
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
                    "volumes": [{"name": "cache", "persistentVolumeClaim": claim}, scratch],
                    "securityContext": b.pod_security(),
                    "automountServiceAccountToken": False,
                    "enableServiceLinks": False,
                    **images.secrets(),
                },
            },
        },
    }
