"""How the operator scales: 64 replicas vs 8 on the local control plane, one run.

The test kubelet runs in a mode that reports pods Running and Ready without
starting processes, so what is timed is the operator and the control plane:
apply → all pods created, apply → status.readyReplicas = N, and one pod deleted →
its replacement exists. Last line:
``create64_s=<x> ready64_s=<y> replace_s=<z> per_replica_ratio_64_vs_8=<r>``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dpserve.local import free_port
from tests.cluster.localcluster import LocalCluster

REPO = Path(__file__).resolve().parent.parent
NS = "scale"


def _dsvc(name: str, replicas: int) -> str:
    return json.dumps(
        {
            "apiVersion": "dpserve.dev/v1alpha1",
            "kind": "DiffusionService",
            "metadata": {"name": name, "namespace": NS},
            "spec": {"model": {"path": "/models/tiny"}, "device": "cpu", "replicas": replicas},
        }
    )


def _get(cluster: LocalCluster, *what: str) -> Any:
    return json.loads(cluster.kubectl("-n", NS, "get", *what, "-o", "json").stdout)


def _replica_pods(cluster: LocalCluster, name: str) -> list[dict[str, Any]]:
    selector = f"app.kubernetes.io/instance={name},app.kubernetes.io/component=replica"
    return list(_get(cluster, "pods", "-l", selector)["items"])


def _wait(check: Any, timeout_s: float = 300) -> float:
    started = time.monotonic()
    while not check():
        if time.monotonic() - started > timeout_s:
            raise TimeoutError("benchmark step did not finish")
        time.sleep(0.05)
    return time.monotonic() - started


def measure(cluster: LocalCluster, name: str, replicas: int) -> dict[str, float]:
    started = time.monotonic()
    cluster.kubectl("apply", "-f", "-", input=_dsvc(name, replicas))
    _wait(lambda: len(_replica_pods(cluster, name)) == replicas)
    created = time.monotonic() - started

    def ready() -> bool:
        status = _get(cluster, "dsvc", name).get("status") or {}
        return bool(status.get("readyReplicas") == replicas)

    _wait(ready)
    ready_s = time.monotonic() - started
    victim = f"{name}-replica-{replicas // 2}"
    uid = next(p for p in _replica_pods(cluster, name) if p["metadata"]["name"] == victim)
    old_uid = uid["metadata"]["uid"]
    started = time.monotonic()
    cluster.kubectl("-n", NS, "delete", "pod", victim, "--wait=false")

    def replaced() -> bool:
        return any(
            p["metadata"]["name"] == victim and p["metadata"]["uid"] != old_uid
            for p in _replica_pods(cluster, name)
        )

    _wait(replaced)
    return {"create": created, "ready": ready_s, "replace": time.monotonic() - started}


def main() -> None:
    cluster = LocalCluster.start(run_processes=False)
    operator = None
    try:
        cluster.kubectl("apply", "-f", str(REPO / "charts/dpserve/crds"))
        cluster.kubectl("wait", "--for=condition=Established", "crd/diffusionservices.dpserve.dev")
        cluster.kubectl("create", "namespace", NS)
        has_sa = ("-n", NS, "get", "sa", "default")
        _wait(lambda: cluster.kubectl(*has_sa, check=False).returncode == 0)
        operator = subprocess.Popen(
            [sys.executable, "-m", "dpserve", "operator", "--all-namespaces",
             "--liveness-port", str(free_port())],
            env=cluster.env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        small = measure(cluster, "small", 8)
        large = measure(cluster, "large", 64)
    finally:
        if operator is not None:
            operator.terminate()
            operator.wait(timeout=30)
        cluster.stop()
    ratio = (large["ready"] / 64) / (small["ready"] / 8)
    for n, figures in ((8, small), (64, large)):
        print(
            f"replicas={n} create={figures['create']:.2f}s ready={figures['ready']:.2f}s "
            f"replace={figures['replace']:.2f}s"
        )
    print(
        f"create64_s={large['create']:.2f} ready64_s={large['ready']:.2f} "
        f"replace_s={large['replace']:.2f} per_replica_ratio_64_vs_8={ratio:.2f}"
    )


if __name__ == "__main__":
    main()
