"""The dpserve chart installed namespaced, in namespaces that enforce the "restricted"
Pod Security Standard: where every Kubernetes journey starts (test_kubernetes_journey,
test_model_source_journey).

Several modules of one run share the session's cluster, so the namespaces are applied
(made, or found from an earlier module), and on leaving the module's services (and their
pods) are deleted and the release uninstalled.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from tests.e2e.backends import Backend
from tests.polling import eventually

REPO = Path(__file__).resolve().parents[2]
OPERATOR_NS = "dpserve-system"
RESTRICTED = {
    "pod-security.kubernetes.io/enforce": "restricted",
    "pod-security.kubernetes.io/enforce-version": "latest",
}
B = TypeVar("B", bound=Backend)


def restricted_namespace(backend: Backend, name: str) -> None:
    namespace = {"apiVersion": "v1", "kind": "Namespace",
                 "metadata": {"name": name, "labels": RESTRICTED}}  # fmt: skip
    backend.kubectl("apply", "-f", "-", input=json.dumps(namespace))


@contextmanager
def operator_installed(backend: B, namespace: str, *values: str) -> Iterator[B]:
    """The operator watching ``namespace`` only: a Role there and nothing cluster-wide
    (``values``: more ``--set`` flags for the chart)."""
    restricted_namespace(backend, OPERATOR_NS)
    restricted_namespace(backend, namespace)
    backend.helm("install", "dpserve", str(REPO / "charts/dpserve"), "-n", OPERATOR_NS,
                 f"--set=watchNamespaces={{{namespace}}}", *values,
                 *backend.helm_values())  # fmt: skip
    try:
        eventually(
            lambda: backend.pod_ready(OPERATOR_NS, "app.kubernetes.io/name=dpserve"),
            what="the operator pod",
        )
        eventually(lambda: backend.kubectl("-n", namespace, "get", "sa", "default", check=False)
                   .returncode == 0, what="default service account")  # fmt: skip
        yield backend
    finally:
        try:
            remove_services(backend, namespace)
        finally:
            backend.helm("uninstall", "dpserve", "-n", OPERATOR_NS, check=False)


def remove_services(backend: Backend, namespace: str) -> None:
    """Every DiffusionService of ``namespace`` and what it owns, gone before the operator
    goes (its finalizer needs it). Left behind, a module's replicas would hold the next
    modules' nodes: a drain there would wait on their budget, which nothing restores
    without an operator to recreate an evicted replica."""
    backend.kubectl("-n", namespace, "delete", "dsvc", "--all", "--cascade=foreground",
                    "--wait=true", "--timeout=300s", check=False)  # fmt: skip
    ours = ("pods", "-l", "app.kubernetes.io/name=dpserve")
    eventually(lambda: not backend.get(namespace, *ours)["items"], 300, f"{namespace}'s pods gone")
