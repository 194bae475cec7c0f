"""How the operator scales, one run.

Default: 64 replicas vs 8 on the local control plane. The test kubelet runs in a mode
that reports pods Running and Ready without starting processes, so what is timed is
the operator and the control plane: apply → all pods created, apply →
status.readyReplicas = N, and one pod deleted → its replacement exists. Last line:
``create64_s=<x> ready64_s=<y> replace_s=<z> per_replica_ratio_64_vs_8=<r>``.

``--real-node``: 8 replicas of the tiny model on a real node (kubelet, containerd,
runc; tests/cluster/realcluster.py) from the images ``make images`` builds, so what is
timed includes containers starting, torch importing and the model loading, all on
this machine's cores. Pod start to Ready is read from each pod's conditions
(scheduled → Ready, whole seconds): of the replicas that started together (with the
router beside them), and of the one deleted afterwards, whose replacement starts
alone. Last line: ``ready8_s=<x> replica_alone_s=<a> replica_together_p50_s=<t>
router_start_s=<r> replace_ready_s=<w> ready8_over_one_pod=<x/a>``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dpserve.plumbing.ports import free_port
from tests.cluster.localcluster import LocalCluster
from tests.images.build import build_images

REPO = Path(__file__).resolve().parent.parent
NS = "scale"


class Cluster(Protocol):
    def kubectl(
        self, *args: str, check: bool = True, input: str | None = None
    ) -> subprocess.CompletedProcess[str]: ...

    def env(self) -> dict[str, str]: ...


def _dsvc(name: str, replicas: int) -> str:
    # No resources: BestEffort pods, so 8 fit a 2-core node's scheduler.
    spec = {"model": {"path": "/models/tiny"}, "device": "cpu", "threadsPerRank": 1}
    return json.dumps(
        {
            "apiVersion": "dpserve.dev/v1alpha1",
            "kind": "DiffusionService",
            "metadata": {"name": name, "namespace": NS},
            "spec": {**spec, "replicas": replicas},
        }
    )


def _get(cluster: Cluster, *what: str) -> Any:
    return json.loads(cluster.kubectl("-n", NS, "get", *what, "-o", "json").stdout)


def _replica_pods(cluster: Cluster, name: str) -> list[dict[str, Any]]:
    selector = f"app.kubernetes.io/instance={name},app.kubernetes.io/component=replica"
    return list(_get(cluster, "pods", "-l", selector)["items"])


def _wait(check: Any, timeout_s: float = 300) -> float:
    started = time.monotonic()
    while not check():
        if time.monotonic() - started > timeout_s:
            raise TimeoutError("benchmark step did not finish")
        time.sleep(0.05)
    return time.monotonic() - started


def measure(
    cluster: Cluster, name: str, replicas: int, replaced_ready: bool = False
) -> dict[str, float]:
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
            p["metadata"]["name"] == victim
            and p["metadata"]["uid"] != old_uid
            and (not replaced_ready or _ready_at(p) is not None)
            for p in _replica_pods(cluster, name)
        )

    _wait(replaced)
    return {"create": created, "ready": ready_s, "replace": time.monotonic() - started}


def _condition_time(pod: dict[str, Any], kind: str) -> datetime | None:
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond["type"] == kind and cond["status"] == "True":
            return datetime.fromisoformat(cond["lastTransitionTime"].replace("Z", "+00:00"))
    return None


def _ready_at(pod: dict[str, Any]) -> datetime | None:
    return _condition_time(pod, "Ready")


def start_to_ready_s(pod: dict[str, Any]) -> float:
    """Scheduled → Ready of one pod, from its own conditions (whole seconds)."""
    scheduled, ready = _condition_time(pod, "PodScheduled"), _ready_at(pod)
    assert scheduled is not None and ready is not None, pod["metadata"]["name"]
    return (ready - scheduled).total_seconds()


def _prepare(cluster: Cluster, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """The CRD, the namespace, and the operator as a local process."""
    cluster.kubectl("apply", "-f", str(REPO / "charts/dpserve/crds"))
    cluster.kubectl("wait", "--for=condition=Established", "crd/diffusionservices.dpserve.dev")
    cluster.kubectl("create", "namespace", NS)
    has_sa = ("-n", NS, "get", "sa", "default")
    _wait(lambda: cluster.kubectl(*has_sa, check=False).returncode == 0)
    return subprocess.Popen(
        [sys.executable, "-m", "dpserve", "operator", "--all-namespaces",
         "--liveness-port", str(free_port())],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip


def _stop(operator: subprocess.Popen[bytes] | None) -> None:
    if operator is not None:
        operator.terminate()
        operator.wait(timeout=30)


def real_node() -> None:
    from tests.cluster.controlplane import build_binaries
    from tests.cluster.realcluster import RealCluster
    from tests.cluster.registry import Registry, deliver

    images = build_images()
    cluster = RealCluster.start()
    operator = None
    try:
        deliver(images, cluster.node, Registry(build_binaries() / "registry"))
        env = {
            **cluster.env(),
            "DPSERVE_WORKER_IMAGE": images["worker"].ref,
            "DPSERVE_ROUTER_IMAGE": images["router"].ref,
            "DPSERVE_IMAGE_PULL_POLICY": "Never",
        }
        operator = _prepare(cluster, env)
        figures = measure(cluster, "eight", 8, replaced_ready=True)
        pods = {p["metadata"]["name"]: p for p in _replica_pods(cluster, "eight")}
        # The replacement started alone; the other seven started together with it gone.
        alone = start_to_ready_s(pods.pop(f"eight-replica-{8 // 2}"))
        together = [start_to_ready_s(p) for p in pods.values()]
        selector = "app.kubernetes.io/instance=eight,app.kubernetes.io/component=router"
        (router,) = _get(cluster, "pods", "-l", selector)["items"]
        router_s = start_to_ready_s(router)
    finally:
        _stop(operator)
        cluster.stop()
    print(f"start to Ready of the replicas started together (s): {sorted(together)}")
    print(
        f"ready8_s={figures['ready']:.1f} replica_alone_s={alone:.1f} "
        f"replica_together_p50_s={statistics.median(together):.1f} "
        f"router_start_s={router_s:.1f} replace_ready_s={figures['replace']:.1f} "
        f"ready8_over_one_pod={figures['ready'] / max(alone, 1.0):.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--real-node", action="store_true", help="8 real replicas on a real node")
    if parser.parse_args().real_node:
        real_node()
        return
    cluster = LocalCluster.start(run_processes=False)
    operator = None
    try:
        operator = _prepare(cluster, cluster.env())
        small = measure(cluster, "small", 8)
        large = measure(cluster, "large", 64)
    finally:
        _stop(operator)
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
