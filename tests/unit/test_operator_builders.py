"""Pure builders against expected manifests."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from dpserve.operator import builders as b
from dpserve.operator.spec import DiffusionServiceSpec

IMAGES = b.Images(worker="reg/dpserve-worker:1", router="reg/dpserve-router:1")


def svc(**spec: Any) -> b.Svc:
    body = {"model": {"path": "/models/qwen"}, **spec}
    return b.Svc("qwen", "ml", "uid-1", 3, DiffusionServiceSpec.model_validate(body))


OWNER = {
    "apiVersion": "dpserve.dev/v1alpha1",
    "kind": "DiffusionService",
    "name": "qwen",
    "uid": "uid-1",
    "controller": True,
    "blockOwnerDeletion": True,
}


def labels(component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "dpserve",
        "app.kubernetes.io/instance": "qwen",
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/managed-by": "dpserve-operator",
    }


def probe(*extra: str) -> dict[str, Any]:
    command = ["dpserve", "probe", "--port", "5575", "--timeout", "3", *extra]
    return {"exec": {"command": command}, "timeoutSeconds": 5}


def test_replica_pod_gpu_cfg2_on_a_pvc() -> None:
    s = svc(
        replicas=4,
        parallelism={"cfg": 2},
        model={"path": "/models/qwen", "volume": {"persistentVolumeClaim": {"claimName": "m"}}},
        env=[{"name": "HF_HOME", "value": "/tmp/hf"}],
        tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    )
    pod = b.build_replica_pod(s, 2, IMAGES)
    expected = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "qwen-replica-2",
            "namespace": "ml",
            "labels": {**labels("replica"), "dpserve.dev/replica": "2"},
            "ownerReferences": [OWNER],
            "annotations": {"dpserve.dev/spec-hash": b.spec_hash(s.spec)},
        },
        "spec": {
            "containers": [
                {
                    "name": "worker",
                    "image": "reg/dpserve-worker:1",
                    "imagePullPolicy": "IfNotPresent",
                    "command": ["dpserve"],
                    "args": [
                        "worker",
                        "--model",
                        "/models/qwen",
                        "--port",
                        "5575",
                        "--bind",
                        "0.0.0.0",
                        "--replica",
                        "2",
                        "--tp",
                        "1",
                        "--sp",
                        "1",
                        "--cfg",
                        "2",
                        "--threads-per-rank",
                        "1",
                        "--device",
                        "cuda",
                        "--drain-timeout",
                        "300",
                        "--max-sessions",
                        "8",
                        "--max-session-mb",
                        "256",
                        "--session-idle-timeout",
                        "60",
                    ],
                    "env": [
                        {
                            "name": "POD_NAME",
                            "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}},
                        },
                        {
                            "name": "POD_IP",
                            "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}},
                        },
                        {"name": "HF_HOME", "value": "/tmp/hf"},
                    ],
                    "ports": [{"name": "zmq", "containerPort": 5575, "protocol": "TCP"}],
                    "resources": {
                        "limits": {"nvidia.com/gpu": 2},
                        "requests": {"nvidia.com/gpu": 2},
                    },
                    "volumeMounts": [
                        {"name": "dshm", "mountPath": "/dev/shm"},
                        {"name": "model", "mountPath": "/models", "readOnly": True},
                    ],
                    "terminationMessagePolicy": "FallbackToLogsOnError",
                    "startupProbe": {**probe(), "periodSeconds": 5, "failureThreshold": 360},
                    "readinessProbe": {**probe(), "periodSeconds": 5},
                    "livenessProbe": {
                        **probe("--live"),
                        "periodSeconds": 15,
                        "failureThreshold": 4,
                    },
                }
            ],
            "volumes": [
                {"name": "dshm", "emptyDir": {"medium": "Memory"}},
                {"name": "model", "persistentVolumeClaim": {"claimName": "m", "readOnly": True}},
            ],
            "restartPolicy": "Always",
            "hostname": "qwen-replica-2",
            "subdomain": "qwen-replicas",
            "terminationGracePeriodSeconds": 330,
            "securityContext": {"runAsNonRoot": True},
            "enableServiceLinks": False,
            "tolerations": [
                {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
            ],
        },
    }
    assert pod == expected


def test_cpu_replica_requests_no_gpu_and_passes_layout_flags() -> None:
    s = svc(
        device="cpu",
        parallelism={"sp": 4, "ulysses": 2, "ring": 2, "tp": 2},
        resources={"limits": {"cpu": "2"}},
        maxSequenceLength=77,
        threadsPerRank=2,
    )
    container = b.build_replica_pod(s, 0, IMAGES)["spec"]["containers"][0]
    assert container["resources"] == {"limits": {"cpu": "2"}}
    args = container["args"]
    assert args[args.index("--ulysses") + 1] == "2" and args[args.index("--ring") + 1] == "2"
    assert args[args.index("--max-sequence-length") + 1] == "77"
    assert args[args.index("--max-sessions") + 1] == "8"  # realtime defaults reach the worker
    assert args[args.index("--session-idle-timeout") + 1] == "60"
    assert args[args.index("--threads-per-rank") + 1] == "2"
    assert args[args.index("--device") + 1] == "cpu"


def test_spec_hash_ignores_scale_router_and_strategy() -> None:
    base = svc()
    assert b.spec_hash(base.spec) == b.spec_hash(svc(replicas=7, router={"replicas": 3}).spec)
    assert b.spec_hash(base.spec) == b.spec_hash(svc(updateStrategy={"maxSurge": 2}).spec)
    assert b.spec_hash(base.spec) != b.spec_hash(svc(env=[{"name": "A", "value": "1"}]).spec)
    assert b.spec_hash(base.spec) != b.spec_hash(svc(image="other:2").spec)


def test_headless_service_and_router_objects() -> None:
    s = svc(router={"replicas": 2, "service": {"type": "LoadBalancer", "port": 8080}})
    headless = b.build_headless_service(s)
    assert headless == {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": "qwen-replicas",
            "namespace": "ml",
            "labels": labels("replica"),
            "ownerReferences": [OWNER],
        },
        "spec": {
            "clusterIP": "None",
            "selector": {
                "app.kubernetes.io/name": "dpserve",
                "app.kubernetes.io/instance": "qwen",
                "app.kubernetes.io/component": "replica",
            },
            "ports": [{"name": "zmq", "port": 5575, "targetPort": "zmq"}],
            "publishNotReadyAddresses": False,
        },
    }
    deployment = b.build_router_deployment(s, IMAGES)
    assert deployment["spec"]["replicas"] == 2
    pod = deployment["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "qwen-router"
    container = pod["containers"][0]
    assert container["image"] == "reg/dpserve-router:1"
    args = container["args"]
    assert args[:5] == ["router", "--discovery", "kubernetes", "--namespace", "ml"]
    assert args[args.index("--service") + 1] == "qwen-replicas"
    assert args[args.index("--control-state-configmap") + 1] == "qwen-control-state"
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/livez"
    template_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= template_labels.items()
    service = b.build_router_service(s)
    assert service["metadata"]["name"] == "qwen"
    assert service["spec"]["type"] == "LoadBalancer"
    assert service["spec"]["ports"] == [{"name": "http", "port": 8080, "targetPort": "http"}]


def test_router_rbac_reads_slices_and_only_its_own_configmap() -> None:
    sa, role, binding = b.build_router_rbac(svc())
    assert sa["kind"] == "ServiceAccount" and sa["metadata"]["name"] == "qwen-router"
    assert role["rules"] == [
        {
            "apiGroups": ["discovery.k8s.io"],
            "resources": ["endpointslices"],
            "verbs": ["list", "watch"],
        },
        {
            "apiGroups": [""],
            "resources": ["configmaps"],
            "verbs": ["get", "update"],
            "resourceNames": ["qwen-control-state"],
        },
    ]
    assert binding["roleRef"]["name"] == "qwen-router"
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "qwen-router", "namespace": "ml"}
    ]


def test_every_child_is_owned_and_labelled() -> None:
    children = [*b.build_children(svc(), IMAGES), b.build_replica_pod(svc(), 0, IMAGES)]
    kinds = sorted(c["kind"] for c in children)
    assert kinds == sorted(
        [
            "Service",
            "ConfigMap",
            "ServiceAccount",
            "Role",
            "RoleBinding",
            "Deployment",
            "Service",
            "Pod",
        ]
    )
    for child in children:
        assert child["metadata"]["ownerReferences"] == [OWNER]
        assert child["metadata"]["labels"]["app.kubernetes.io/instance"] == "qwen"


def test_control_state_configmap_starts_with_no_replica_out_of_sync() -> None:
    assert b.build_control_state(svc()) == {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": "qwen-control-state",
            "namespace": "ml",
            "labels": labels("router"),
            "ownerReferences": [OWNER],
        },
        "data": {"replicas": "{}"},
    }


def test_event_names_the_diffusionservice_and_lets_the_server_pick_its_name() -> None:
    owner = {"metadata": {"name": "qwen", "namespace": "ml", "uid": "uid-1"}}
    now = datetime(2026, 12, 1, 12, 0, 5, tzinfo=timezone.utc)
    event = b.build_event(owner, "Normal", "ReplicaCreated", "created pod qwen-replica-0", now)
    assert event == {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": "qwen.", "namespace": "ml"},
        "involvedObject": {
            "apiVersion": "dpserve.dev/v1alpha1",
            "kind": "DiffusionService",
            "name": "qwen",
            "namespace": "ml",
            "uid": "uid-1",
        },
        "type": "Normal",
        "reason": "ReplicaCreated",
        "message": "created pod qwen-replica-0",
        "source": {"component": "dpserve-operator"},
        "reportingComponent": "dpserve-operator",
        "firstTimestamp": "2026-12-01T12:00:05Z",
        "lastTimestamp": "2026-12-01T12:00:05Z",
        "count": 1,
    }
    long = b.build_event(owner, "Warning", "SpecRefused", "x" * 5000, now)
    assert len(long["message"]) == 1000
