"""Pure builders against expected manifests."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

import pytest

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
    script = (
        'exec dpserve probe --host "$POD_IP" --port 5575 --timeout 3 '
        "--wire-key-file /etc/dpserve/wire/wire.key"
    )
    command = ["sh", "-c", " ".join([script, *extra])]
    return {"exec": {"command": command}, "timeoutSeconds": 5}


REPLICA_SELECTOR = {
    "app.kubernetes.io/name": "dpserve",
    "app.kubernetes.io/instance": "qwen",
    "app.kubernetes.io/component": "replica",
}

RESTRICTED_POD = {
    "runAsNonRoot": True,
    "runAsUser": 10001,
    "runAsGroup": 10001,
    "fsGroup": 10001,
    "seccompProfile": {"type": "RuntimeDefault"},
}
RESTRICTED_CONTAINER = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
}
SCRATCH_ENV = [
    {"name": "USER", "value": "dpserve"},
    {"name": "HOME", "value": "/tmp"},
    {"name": "XDG_CACHE_HOME", "value": "/tmp/.cache"},
    {"name": "HF_HOME", "value": "/tmp/.cache/huggingface"},
    {"name": "TRITON_CACHE_DIR", "value": "/tmp/.cache/triton"},
    {"name": "TORCHINDUCTOR_CACHE_DIR", "value": "/tmp/.cache/torchinductor"},
    {"name": "MPLCONFIGDIR", "value": "/tmp/.cache/matplotlib"},
    {"name": "PYTHONDONTWRITEBYTECODE", "value": "1"},
]


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
                        "$(POD_IP)",
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
                        "--max-batch",
                        "1",
                        "--batch-wait-ms",
                        "10",
                        "--drain-timeout",
                        "300",
                        "--max-sessions",
                        "8",
                        "--max-session-mb",
                        "256",
                        "--session-idle-timeout",
                        "60",
                        "--max-frames",
                        "129",
                        "--video-ttl",
                        "3600.0",
                        "--video-max-bytes",
                        str(2 << 30),
                        "--lora-cache-mb",
                        "1024",
                        "--wire-key-file",
                        "/etc/dpserve/wire/wire.key",
                        "--allow-path",
                        "/models",
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
                        *SCRATCH_ENV,
                        {"name": "HF_HOME", "value": "/tmp/hf"},  # the user's, after ours: wins
                    ],
                    "ports": [{"name": "zmq", "containerPort": 5575, "protocol": "TCP"}],
                    "resources": {
                        "limits": {"nvidia.com/gpu": 2},
                        "requests": {"nvidia.com/gpu": 2},
                    },
                    "volumeMounts": [
                        {"name": "dshm", "mountPath": "/dev/shm"},
                        {"name": "model", "mountPath": "/models", "readOnly": True},
                        {"name": "wire", "mountPath": "/etc/dpserve/wire", "readOnly": True},
                        {"name": "scratch", "mountPath": "/tmp"},
                    ],
                    "terminationMessagePolicy": "FallbackToLogsOnError",
                    "startupProbe": {**probe(), "periodSeconds": 5, "failureThreshold": 360},
                    "readinessProbe": {**probe(), "periodSeconds": 5},
                    "livenessProbe": {
                        **probe("--live"),
                        "periodSeconds": 15,
                        "failureThreshold": 4,
                    },
                    "securityContext": RESTRICTED_CONTAINER,
                }
            ],
            "volumes": [
                {"name": "dshm", "emptyDir": {"medium": "Memory"}},
                {"name": "model", "persistentVolumeClaim": {"claimName": "m", "readOnly": True}},
                {"name": "wire", "secret": {"secretName": "qwen-wire", "defaultMode": 0o440}},
                {"name": "scratch", "emptyDir": {}},
            ],
            "restartPolicy": "Always",
            "hostname": "qwen-replica-2",
            "subdomain": "qwen-replicas",
            "terminationGracePeriodSeconds": 330,
            "securityContext": RESTRICTED_POD,
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "tolerations": [
                {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
            ],
            # Spread over nodes by default, as a preference (docs/kubernetes.md).
            "topologySpreadConstraints": [
                {
                    "topologyKey": "kubernetes.io/hostname",
                    "maxSkew": 1,
                    "whenUnsatisfiable": "ScheduleAnyway",
                    "labelSelector": {"matchLabels": REPLICA_SELECTOR},
                }
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
        maxBatch=4,
        batchWaitMs=0,
    )
    container = b.build_replica_pod(s, 0, IMAGES)["spec"]["containers"][0]
    assert container["resources"] == {"limits": {"cpu": "2"}}
    args = container["args"]
    assert args[args.index("--ulysses") + 1] == "2" and args[args.index("--ring") + 1] == "2"
    assert args[args.index("--max-sequence-length") + 1] == "77"
    assert args[args.index("--max-sessions") + 1] == "8"  # realtime defaults reach the worker
    assert args[args.index("--session-idle-timeout") + 1] == "60"
    assert args[args.index("--threads-per-rank") + 1] == "2"
    assert args[args.index("--max-batch") + 1] == "4"  # dynamic batching (docs/worker.md)
    assert args[args.index("--batch-wait-ms") + 1] == "0"
    assert args[args.index("--device") + 1] == "cpu"
    assert args[args.index("--video-ttl") + 1] == "3600.0"  # video jobs (docs/video.md)


def test_spec_hash_ignores_scale_router_and_strategy() -> None:
    base = svc()
    assert b.spec_hash(base.spec) == b.spec_hash(svc(replicas=7, router={"replicas": 3}).spec)
    assert b.spec_hash(base.spec) == b.spec_hash(svc(updateStrategy={"maxSurge": 2}).spec)
    assert b.spec_hash(base.spec) != b.spec_hash(svc(env=[{"name": "A", "value": "1"}]).spec)
    assert b.spec_hash(base.spec) != b.spec_hash(svc(image="other:2").spec)


def test_a_lora_cache_of_its_own_size_rolls_the_replicas_the_default_does_not() -> None:
    # The default hashes as before adapter caches existed: an operator upgrade rolls none.
    assert b.spec_hash(svc(loraCacheMb=1024).spec) == b.spec_hash(svc().spec)
    assert b.spec_hash(svc(loraCacheMb=2048).spec) != b.spec_hash(svc().spec)
    args = b.build_replica_pod(svc(loraCacheMb=2048), 0, IMAGES)["spec"]["containers"][0]["args"]
    assert args[args.index("--lora-cache-mb") + 1] == "2048"


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
    children.append(b.build_wire_secret(svc(), b"k" * 40))
    kinds = sorted(c["kind"] for c in children)
    assert kinds == sorted(
        [
            "Service",
            "NetworkPolicy",
            "PodDisruptionBudget",
            "PodDisruptionBudget",
            "Secret",
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


def test_a_model_baked_into_the_image_allows_its_mount_path_only() -> None:
    args = b.build_replica_pod(svc(), 0, IMAGES)["spec"]["containers"][0]["args"]
    assert args[args.index("--allow-path") + 1] == "/models" and args.count("--allow-path") == 1
    assert args[args.index("--wire-key-file") + 1] == "/etc/dpserve/wire/wire.key"


def test_wire_secret_holds_the_key_and_is_owned() -> None:
    assert b.build_wire_secret(svc(), b"x" * 40) == {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": "qwen-wire",
            "namespace": "ml",
            "labels": labels("wire"),
            "ownerReferences": [OWNER],
        },
        "type": "Opaque",
        "stringData": {"wire.key": "x" * 40},
    }


def test_network_policy_admits_only_the_routers_on_the_zmq_port() -> None:
    replica = {k: v for k, v in labels("replica").items() if k != "app.kubernetes.io/managed-by"}
    router = {k: v for k, v in labels("router").items() if k != "app.kubernetes.io/managed-by"}
    assert b.build_network_policy(svc(schedulerPort=6000)) == {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {
            "name": "qwen-replicas",
            "namespace": "ml",
            "labels": labels("replica"),
            "ownerReferences": [OWNER],
        },
        "spec": {
            "podSelector": {"matchLabels": replica},
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    "from": [{"podSelector": {"matchLabels": router}}],
                    "ports": [{"protocol": "TCP", "port": 6000}],
                }
            ],
        },
    }
    # The router Deployment's pods carry the labels the policy admits.
    pod_labels = b.build_router_deployment(svc(), IMAGES)["spec"]["template"]["metadata"]
    assert router.items() <= pod_labels["labels"].items()


def test_router_pods_are_restricted_and_mount_the_wire_key() -> None:
    pod = b.build_router_deployment(svc(), IMAGES)["spec"]["template"]["spec"]
    assert pod["securityContext"] == RESTRICTED_POD
    (container,) = pod["containers"]
    assert container["securityContext"] == RESTRICTED_CONTAINER
    assert container["env"] == SCRATCH_ENV
    assert container["volumeMounts"] == [
        {"name": "wire", "mountPath": "/etc/dpserve/wire", "readOnly": True},
        {"name": "scratch", "mountPath": "/tmp"},
    ]
    assert pod["volumes"] == [
        {"name": "wire", "secret": {"secretName": "qwen-wire", "defaultMode": 0o440}},
        {"name": "scratch", "emptyDir": {"sizeLimit": "64Mi"}},
    ]
    args = container["args"]
    assert args[args.index("--wire-key-file") + 1] == "/etc/dpserve/wire/wire.key"
    assert "--api-key-file" not in args and "--admin-key-file" not in args


def test_router_auth_mounts_the_users_secret_and_passes_the_key_files() -> None:
    deployment = b.build_router_deployment(svc(router={"auth": {"secretName": "keys"}}), IMAGES)
    pod = deployment["spec"]["template"]["spec"]
    assert {"name": "auth", "secret": {"secretName": "keys", "defaultMode": 0o440}} in pod[
        "volumes"
    ]
    (container,) = pod["containers"]
    assert {"name": "auth", "mountPath": "/etc/dpserve/auth", "readOnly": True} in container[
        "volumeMounts"
    ]
    args = container["args"]
    assert args[args.index("--api-key-file") + 1] == "/etc/dpserve/auth/api-keys"
    assert args[args.index("--admin-key-file") + 1] == "/etc/dpserve/auth/admin-keys"


def test_router_webhook_mounts_the_users_secret_and_its_flags_reach_the_settings(
    tmp_path: Any,
) -> None:
    import base64

    from pydantic import ValidationError

    from dpserve.cli import _router_settings, build_parser

    hook = {"url": "https://hooks.example.com/dpserve", "secretName": "hook"}
    deployment = b.build_router_deployment(svc(router={"webhook": hook}), IMAGES)
    pod = deployment["spec"]["template"]["spec"]
    assert {"name": "webhook", "secret": {"secretName": "hook", "defaultMode": 0o440}} in pod[
        "volumes"
    ]
    (container,) = pod["containers"]
    mount = {"name": "webhook", "mountPath": "/etc/dpserve/webhook", "readOnly": True}
    assert mount in container["volumeMounts"]
    args = container["args"]
    assert args[args.index("--webhook-url") + 1] == hook["url"]
    assert args[args.index("--webhook-secret-file") + 1] == "/etc/dpserve/webhook/webhook-secret"
    assert args[args.index("--webhook-retry-for") + 1] == "3600"
    # The router reads the mounted key while parsing: here, from a file of the same form.
    key = bytes(range(32))
    secret = tmp_path / "webhook-secret"
    secret.write_text("whsec_" + base64.b64encode(key).decode())
    args = [str(secret) if a.startswith("/etc/dpserve/webhook/") else a for a in args]
    parsed = build_parser().parse_args(args)
    parsed.wire_key_file = None  # the wire key's own file is not here either
    webhook = _router_settings(parsed, ()).webhook
    assert webhook is not None and (webhook.url, webhook.key) == (hook["url"], key)
    assert webhook.retry_for_s == 3600
    plain = b.router_args(svc())
    assert not any(a.startswith("--webhook") for a in plain)
    assert not any(
        v.get("name") == "webhook"
        for v in b.build_router_deployment(svc(), IMAGES)["spec"]["template"]["spec"]["volumes"]
    )
    for bad in ("ftp://x/h", "https://u:p@x/h", "https://x/h#frag", "not a url"):
        with pytest.raises(ValidationError):
            svc(router={"webhook": {**hook, "url": bad}})
    with pytest.raises(ValidationError):
        svc(router={"webhook": {"url": hook["url"], "secretName": ""}})


def test_router_worker_and_probe_args_parse_with_the_cli() -> None:
    import argparse

    from dpserve.cli import build_parser

    s = svc(model={"path": "/models/qwen", "volume": {"persistentVolumeClaim": {"claimName": "m"}}})
    parser = build_parser()
    router = parser.parse_args(b.router_args(s))
    assert str(router.wire_key_file) == "/etc/dpserve/wire/wire.key"
    worker = parser.parse_args(b.worker_args(s, 0))
    assert str(worker.wire_key_file) == "/etc/dpserve/wire/wire.key"
    probe_script = b.probe_command(5575)[-1]
    probe = parser.parse_args(probe_script.replace('"$POD_IP"', "10.0.0.1").split()[2:])
    assert probe.host == "10.0.0.1" and str(probe.wire_key_file).endswith("wire.key")
    # The key files are read while parsing (absent here): the flags exist, that is all.
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    flags = {o for a in sub.choices["router"]._actions for o in a.option_strings}
    with_auth = b.router_args(svc(router={"auth": {"secretName": "keys"}}))
    assert {a for a in with_auth if a.startswith("--")} <= flags


def test_router_policy_reaches_the_router_and_the_crd_names_the_clis_choices() -> None:
    from dpserve.cli import build_parser
    from dpserve.operator.spec import RouterSpec
    from dpserve.router.policies import POLICIES

    parser = build_parser()
    assert parser.parse_args(b.router_args(svc())).policy == "least_work"  # the default
    chosen = parser.parse_args(b.router_args(svc(router={"policy": "round_robin"})))
    assert chosen.policy == "round_robin"
    schema = RouterSpec.model_json_schema()["properties"]["policy"]
    assert sorted(schema["enum"]) == sorted(POLICIES)
    with pytest.raises(ValueError, match="policy"):
        svc(router={"policy": "random"})


def test_the_served_model_name_reaches_the_router_and_rolls_no_replica() -> None:
    import re

    from dpserve.cli import build_parser
    from dpserve.operator.spec import RouterSpec
    from dpserve.router.served_model import check_name

    parser = build_parser()
    assert parser.parse_args(b.router_args(svc())).served_model_name == "qwen"  # its name
    named = svc(router={"servedModelName": "Qwen/Qwen-Image"})
    assert parser.parse_args(b.router_args(named)).served_model_name == "Qwen/Qwen-Image"
    assert b.spec_hash(named.spec) == b.spec_hash(svc().spec)  # the replicas stay
    router = b.build_router_deployment(named, IMAGES)["spec"]["template"]["spec"]
    assert "Qwen/Qwen-Image" in router["containers"][0]["args"]
    # The CRD's rule is the router's: what the apiserver admits, the router starts with.
    schema = RouterSpec.model_json_schema()["properties"]["servedModelName"]["anyOf"][0]
    for name in ("tiny", "a/b:c", "two words", "é", "", "x" * 257):
        admitted = (
            re.fullmatch(schema["pattern"].strip("^$"), name) is not None
            and schema["minLength"] <= len(name) <= schema["maxLength"]
        )
        try:
            started = check_name(name) == name
        except ValueError:
            started = False
        assert admitted == started, name
        if not admitted:
            with pytest.raises(ValueError, match="servedModelName"):
                svc(router={"servedModelName": name})


def test_the_video_job_bound_reaches_the_router_and_leaves_the_replicas_alone() -> None:
    """spec.router.videoMaxEstimateSeconds is the router's --video-max-estimate: a
    router setting, so changing it rolls the router, not the model servers."""
    from dpserve.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(b.router_args(svc())).video_max_estimate == 1800.0
    shorter = svc(router={"videoMaxEstimateSeconds": 600})
    assert parser.parse_args(b.router_args(shorter)).video_max_estimate == 600.0
    assert b.spec_hash(shorter.spec) == b.spec_hash(svc().spec)
    deployment = b.build_router_deployment(shorter, IMAGES)
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--video-max-estimate") + 1] == "600"
    with pytest.raises(ValueError, match="videoMaxEstimateSeconds"):
        svc(router={"videoMaxEstimateSeconds": 0})


def test_a_new_pod_shape_rolls_the_replicas(monkeypatch: Any) -> None:
    before = b.spec_hash(svc().spec)
    monkeypatch.setattr(b, "POD_SHAPE", b.POD_SHAPE + 1)
    assert b.spec_hash(svc().spec) != before


def test_the_disruption_budget_follows_max_unavailable_and_never_blocks_a_drain() -> None:
    pdb = b.build_pod_disruption_budget(svc(replicas=4, updateStrategy={"maxUnavailable": 2}))
    assert pdb == {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {
            "name": "qwen-replicas",
            "namespace": "ml",
            "labels": labels("replica"),
            "ownerReferences": [OWNER],
        },
        "spec": {
            "maxUnavailable": 2,
            "selector": {"matchLabels": REPLICA_SELECTOR},
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }
    # The same pods as the replicas' (and the headless Service's) selector.
    pod_labels = b.build_replica_pod(svc(), 0, IMAGES)["metadata"]["labels"]
    assert REPLICA_SELECTOR.items() <= pod_labels.items()
    # A surge-only roll (maxUnavailable 0) and one replica still let a drain evict one.
    surge = svc(replicas=1, updateStrategy={"maxUnavailable": 0, "maxSurge": 1})
    assert b.build_pod_disruption_budget(surge)["spec"]["maxUnavailable"] == 1
    assert b.build_pod_disruption_budget(svc(replicas=1))["spec"]["maxUnavailable"] == 1
    # Scale and the budget do not roll the replicas.
    assert b.spec_hash(svc(updateStrategy={"maxUnavailable": 3}).spec) == b.spec_hash(svc().spec)


def test_the_routers_have_a_budget_of_one_and_spread_over_nodes() -> None:
    router_selector = REPLICA_SELECTOR | {"app.kubernetes.io/component": "router"}
    for count in (0, 1, 2, 5):  # one budget whatever the count: nothing to add or prune
        pdb = b.build_router_disruption_budget(svc(router={"replicas": count}))
        assert pdb == {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": {
                "name": "qwen-router",
                "namespace": "ml",
                "labels": labels("router"),
                "ownerReferences": [OWNER],
            },
            "spec": {
                "maxUnavailable": 1,
                "selector": {"matchLabels": router_selector},
                "unhealthyPodEvictionPolicy": "AlwaysAllow",
            },
        }
    deployment = b.build_router_deployment(svc(router={"replicas": 2}), IMAGES)
    assert deployment["spec"]["replicas"] == 2
    # The budget's and the spread's selectors are the Deployment's pods, routers only.
    assert deployment["spec"]["selector"]["matchLabels"] == router_selector
    pod = deployment["spec"]["template"]["spec"]
    assert pod["topologySpreadConstraints"] == [
        {
            "topologyKey": "kubernetes.io/hostname",
            "maxSkew": 1,
            "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {"matchLabels": router_selector},
        }
    ]
    # The replicas' spread counts replicas only: routers do not skew it.
    replica = b.build_replica_pod(svc(), 0, IMAGES)["spec"]["topologySpreadConstraints"]
    assert replica[0]["labelSelector"]["matchLabels"] == REPLICA_SELECTOR


def test_a_stopping_router_pauses_then_has_its_longest_request_to_finish() -> None:
    pod = b.build_router_deployment(svc(router={"requestTimeoutSeconds": 120}), IMAGES)
    spec = pod["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    assert container["lifecycle"] == {"preStop": {"sleep": {"seconds": b.ROUTER_PAUSE_S}}}
    # The pause, then uvicorn finishes what is in flight, then the lifespan closes.
    assert spec["terminationGracePeriodSeconds"] == b.ROUTER_PAUSE_S + 120 + b.DRAIN_MARGIN_S
    # The router's fields never roll the replicas.
    assert b.spec_hash(svc(router={"replicas": 3}).spec) == b.spec_hash(svc().spec)


def test_spread_is_configurable_and_can_be_turned_off() -> None:
    def spread(**spec: Any) -> Any:
        return b.build_replica_pod(svc(**spec), 0, IMAGES)["spec"].get("topologySpreadConstraints")

    zones = [
        {
            "topologyKey": "topology.kubernetes.io/zone",
            "maxSkew": 2,
            "whenUnsatisfiable": "DoNotSchedule",
            "minDomains": 3,
        }
    ]
    assert spread(topologySpreadConstraints=zones) == [
        {**zones[0], "labelSelector": {"matchLabels": REPLICA_SELECTOR}}
    ]
    assert spread(topologySpreadConstraints=[]) is None  # off: no field at all


def test_one_replica_per_node_adds_to_the_users_affinity() -> None:
    mine = {
        "nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []},
        "podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{"x": 1}]},
    }
    s = svc(onePerNode=True, affinity=mine)
    affinity = b.build_replica_pod(s, 0, IMAGES)["spec"]["affinity"]
    assert affinity["nodeAffinity"] == mine["nodeAffinity"]
    assert affinity["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"] == [
        {"x": 1},
        {
            "labelSelector": {"matchLabels": REPLICA_SELECTOR},
            "topologyKey": "kubernetes.io/hostname",
        },
    ]
    assert s.spec.affinity == mine  # the spec is not changed
    alone = b.build_replica_pod(svc(onePerNode=True), 0, IMAGES)["spec"]["affinity"]
    assert alone == {
        "podAntiAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {
                    "labelSelector": {"matchLabels": REPLICA_SELECTOR},
                    "topologyKey": "kubernetes.io/hostname",
                }
            ]
        }
    }
    assert "affinity" not in b.build_replica_pod(svc(), 0, IMAGES)["spec"]


def test_priority_class_reaches_the_replica_pods() -> None:
    pod = b.build_replica_pod(svc(priorityClassName="gpu-high"), 0, IMAGES)
    assert pod["spec"]["priorityClassName"] == "gpu-high"
    assert "priorityClassName" not in b.build_replica_pod(svc(), 0, IMAGES)["spec"]


@pytest.mark.parametrize(
    "placement",
    [
        {"topologySpreadConstraints": []},
        {"topologySpreadConstraints": [{"topologyKey": "topology.kubernetes.io/zone"}]},
        {"onePerNode": True},
        {"priorityClassName": "gpu-high"},
    ],
)
def test_a_placement_change_rolls_the_replicas_the_defaults_do_not(
    placement: dict[str, Any],
) -> None:
    # Defaults hash as before placement fields existed: an operator upgrade rolls none.
    assert b.spec_hash(svc().spec) == b.spec_hash(svc(onePerNode=False).spec)
    assert b.spec_hash(svc(**placement).spec) != b.spec_hash(svc().spec)
