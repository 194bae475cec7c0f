"""The operator's only door to the Kubernetes API.

Every method declares the (API group, resource, verb) it needs with ``@uses``;
the chart's roles are checked against the union of those declarations plus
what kopf itself needs, so the role grants exactly what the code does
(tests/chart/test_chart.py), and a real apiserver answers SubjectAccessReviews
with exactly that (tests/cluster/test_rbac.py).

Secrets are created, never read: the wire Secret is create-only (409 means it is
there), so the operator holds no get, list or watch on any Secret.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Final, ParamSpec, TypeVar

from kubernetes import client
from kubernetes.client.exceptions import ApiException
from kubernetes.dynamic import DynamicClient

from dpserve.operator import spec as s
from dpserve.operator.builders import ROUTER_RULES

P = ParamSpec("P")
R = TypeVar("R")
FIELD_MANAGER: Final = "dpserve-operator"

Rule = tuple[str, str, str]  # (apiGroup, resource, verb)

# What kopf needs beside our own calls: watch the CRs, keep its annotations on
# them, post events, and watch what the event handlers follow. Namespaces are never
# listed: cluster-wide kopf watches all of them at once, and a namespaced operator
# names its namespaces exactly (kopf's scanning is off then, see handlers.configure).
KOPF_RULES: Final = frozenset(
    {
        (s.GROUP, s.PLURAL, "list"),
        (s.GROUP, s.PLURAL, "watch"),
        (s.GROUP, s.PLURAL, "patch"),
        ("", "events", "create"),
        *(
            (group, resource, verb)
            for group, resource in (
                ("", "pods"),  # replica pods
                ("apps", "deployments"),  # the router Deployment (Ready needs it available)
                ("", "configmaps"),  # the control state (replicas out of sync)
            )
            for verb in ("list", "watch")
        ),
    }
)


# Cluster-wide only: kopf watches the CRDs to notice resources appearing later. A
# namespaced operator turns that scanning off, so it needs nothing cluster-scoped.
KOPF_CLUSTER_RULES: Final = frozenset(
    {
        ("apiextensions.k8s.io", "customresourcedefinitions", "list"),
        ("apiextensions.k8s.io", "customresourcedefinitions", "watch"),
    }
)


def uses(*rules: Rule) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Declare the API permissions a method needs (collected by ``required_rules``)."""

    def mark(fn: Callable[P, R]) -> Callable[P, R]:
        fn.rbac = frozenset(rules)  # type: ignore[attr-defined]
        return fn

    return mark


def required_rules(cluster_wide: bool = True) -> set[Rule]:
    """Every permission the operator needs: its own calls, kopf's, and the router's.

    The router's role is created by the operator, and RBAC lets a subject grant
    only permissions it holds itself. ``cluster_wide=False``: what a namespaced
    operator needs in each namespace it watches (and nothing beyond them).
    """
    own = {rule for fn in vars(Kube).values() for rule in getattr(fn, "rbac", ())}
    granted = {
        (group, resource, verb)
        for rule in ROUTER_RULES
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    return own | set(KOPF_RULES) | granted | (set(KOPF_CLUSTER_RULES) if cluster_wide else set())


class Kube:
    """Blocking client calls, each run in a thread so kopf's event loop never waits."""

    def __init__(self, api_client: client.ApiClient | None = None) -> None:
        self.api = api_client or client.ApiClient()
        self.dyn = DynamicClient(self.api)

    def _resource(self, api_version: str, kind: str) -> Any:
        return self.dyn.resources.get(api_version=api_version, kind=kind)

    async def _run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return await asyncio.to_thread(fn, *args, **kwargs)

    async def _get(
        self, api_version: str, kind: str, namespace: str, name: str
    ) -> dict[str, Any] | None:
        resource = self._resource(api_version, kind)
        try:
            obj = await self._run(resource.get, name=name, namespace=namespace)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return obj.to_dict()

    async def _create(self, obj: dict[str, Any]) -> bool:
        """Create ``obj``; False when one of its name exists already (409)."""
        resource = self._resource(obj["apiVersion"], obj["kind"])
        try:
            await self._run(resource.create, body=obj, namespace=obj["metadata"]["namespace"])
        except ApiException as exc:
            if exc.status == 409:
                return False
            raise
        return True

    @uses((s.GROUP, s.PLURAL, "get"))
    async def get_service(self, namespace: str, name: str) -> dict[str, Any] | None:
        return await self._get(f"{s.GROUP}/{s.VERSION}", s.KIND, namespace, name)

    @uses((s.GROUP, s.PLURAL, "list"))
    async def list_services(self, namespace: str | None) -> list[dict[str, Any]]:
        """DiffusionServices in one namespace, or in all (None)."""
        resource = self._resource(f"{s.GROUP}/{s.VERSION}", s.KIND)
        listed = await self._run(resource.get, namespace=namespace)
        return list(listed.to_dict()["items"])

    @uses((s.GROUP, f"{s.PLURAL}/status", "patch"))
    async def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        custom = client.CustomObjectsApi(self.api)
        await self._run(
            custom.patch_namespaced_custom_object_status,
            s.GROUP,
            s.VERSION,
            namespace,
            s.PLURAL,
            name,
            {"status": status},
        )

    @uses(("", "pods", "list"))
    async def list_pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        pods = self._resource("v1", "Pod")
        listed = await self._run(pods.get, namespace=namespace, label_selector=selector)
        return [item for item in listed.to_dict()["items"]]

    @uses(("", "pods", "create"))
    async def create_pod(self, pod: dict[str, Any]) -> bool:
        """Create; False when a pod of that name still exists (e.g. terminating)."""
        return await self._create(pod)

    @uses(("", "pods", "delete"))
    async def delete_pod(self, namespace: str, name: str) -> None:
        pods = self._resource("v1", "Pod")
        try:
            await self._run(pods.delete, name=name, namespace=namespace)
        except ApiException as exc:
            if exc.status != 404:
                raise

    @uses(
        *(
            (group, resource, verb)
            for group, resource in (
                ("", "services"),
                ("", "serviceaccounts"),
                ("rbac.authorization.k8s.io", "roles"),
                ("rbac.authorization.k8s.io", "rolebindings"),
                ("apps", "deployments"),
                ("networking.k8s.io", "networkpolicies"),
                ("policy", "poddisruptionbudgets"),
            )
            # An apply that creates the object is authorized as a create too.
            for verb in ("patch", "create")
        )
    )
    async def apply(self, obj: dict[str, Any]) -> None:
        """Server-side apply: the operator owns exactly the fields it sets."""
        resource = self._resource(obj["apiVersion"], obj["kind"])
        meta = obj["metadata"]
        await self._run(
            resource.server_side_apply,
            body=obj,
            name=meta["name"],
            namespace=meta["namespace"],
            field_manager=FIELD_MANAGER,
            force_conflicts=True,
        )

    @uses(("apps", "deployments", "get"))
    async def get_deployment(self, namespace: str, name: str) -> dict[str, Any] | None:
        return await self._get("apps/v1", "Deployment", namespace, name)

    @uses(("", "configmaps", "get"))
    async def get_configmap(self, namespace: str, name: str) -> dict[str, Any] | None:
        return await self._get("v1", "ConfigMap", namespace, name)

    @uses(("", "events", "create"))
    async def create_event(self, event: dict[str, Any]) -> None:
        events = self._resource("v1", "Event")
        await self._run(events.create, body=event, namespace=event["metadata"]["namespace"])

    @uses(("batch", "jobs", "get"))
    async def get_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        return await self._get("batch/v1", "Job", namespace, name)

    @uses(("batch", "jobs", "create"))
    async def create_job(self, job: dict[str, Any]) -> bool:
        """Create; False when a Job of that name exists already."""
        return await self._create(job)

    @uses(("batch", "jobs", "delete"))
    async def delete_job(self, namespace: str, name: str) -> None:
        """Delete a Job and, in the background, its pods."""
        jobs = self._resource("batch/v1", "Job")
        try:
            await self._run(
                jobs.delete, name=name, namespace=namespace, propagation_policy="Background"
            )
        except ApiException as exc:
            if exc.status != 404:
                raise

    @uses(("", "pods/log", "get"))
    async def read_log(self, namespace: str, pod: str, container: str, lines: int) -> str | None:
        """The last ``lines`` lines of a container's log; None when there is none to read
        (the container not started, the pod gone, the node not answering)."""
        core = client.CoreV1Api(self.api)
        try:
            text = await self._run(
                core.read_namespaced_pod_log,
                pod,
                namespace,
                container=container,
                tail_lines=lines,
                _request_timeout=10,
            )
        except ApiException:
            return None
        return str(text)

    @uses(("", "configmaps", "create"), ("", "secrets", "create"))
    async def create_if_absent(self, obj: dict[str, Any]) -> bool:
        """For objects made once and never read back: the control state (the routers own
        its content) and the wire Secret (create-only: no read access is needed). False
        when one of its name exists already (whose it is, the caller knows or not)."""
        return await self._create(obj)
