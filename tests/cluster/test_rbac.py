"""The chart's RBAC and the router's Role, asked of a real kube-apiserver.

The chart is rendered (``helm template``) in both modes and its ServiceAccount, roles
and bindings applied; the operator's router Role for one service too. Then every
question is a SubjectAccessReview the apiserver's RBAC authorizer answers: the
operator's and the router's ServiceAccounts may do exactly what the code uses
(``kube.required_rules()``, ``builders.ROUTER_RULES``) and nothing else asked here.
The reviews are counted and the count printed (``-s`` shows it).
"""

from __future__ import annotations

import subprocess
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client as k8s
from kubernetes import config as k8s_config

from dpserve.operator import builders as b
from dpserve.operator.kube import Rule, required_rules
from dpserve.operator.spec import DiffusionServiceSpec
from tests.chart import tools
from tests.cluster.controlplane import ControlPlane
from tests.polling import eventually

pytestmark = pytest.mark.cluster
REPO = Path(__file__).resolve().parents[2]
WIDE_NS, NARROW_NS = "rbac-wide-system", "rbac-narrow-system"  # the releases' namespaces
WATCHED, OTHER = "rbac-team-a", "rbac-team-b"
VERBS = ("get", "list", "watch", "create", "update", "patch", "delete", "deletecollection")
# What the operator must never do (beyond the complement of what it uses).
FORBIDDEN: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    # Secrets: created (the wire key), never read, changed or deleted, its own included.
    ("", "secrets", tuple(v for v in VERBS if v != "create")),
    ("", "pods/exec", VERBS),
    # A fill Job's progress is read from its pod's log: get only.
    ("", "pods/log", tuple(v for v in VERBS if v != "get")),
    ("", "serviceaccounts/token", VERBS),
    ("", "nodes", VERBS),
    ("", "persistentvolumeclaims", VERBS),
    ("rbac.authorization.k8s.io", "clusterroles", VERBS),
    ("rbac.authorization.k8s.io", "clusterrolebindings", VERBS),
)
SVC = b.Svc("tiny", WATCHED, "uid-0", 1, DiffusionServiceSpec.model_validate(
    {"model": {"path": "/models/tiny"}}))  # fmt: skip


def render(release: str, namespace: str, *args: str) -> list[dict[str, Any]]:
    env = tools.helm_env(Path(tempfile.mkdtemp(prefix="dpserve-helm-")))
    out = subprocess.run(
        [str(tools.helm()), "template", release, str(REPO / "charts/dpserve"),
         "--namespace", namespace, *args],
        check=True, capture_output=True, text=True, env=env, timeout=60,
    ).stdout  # fmt: skip
    docs = [d for d in yaml.safe_load_all(out) if d]
    return [d for d in docs if d["kind"] != "Deployment"]  # permissions only: no operator


def router_objects() -> list[dict[str, Any]]:
    objects = b.build_router_rbac(SVC)
    for obj in objects:  # no owner here: the garbage collector would take them
        obj["metadata"].pop("ownerReferences")
    return objects


class Reviews:
    """Asks the apiserver, and counts the answers that came out as expected."""

    def __init__(self, api: k8s.AuthorizationV1Api) -> None:
        self.api = api
        self.count: Counter[str] = Counter()

    def allowed(
        self,
        user: str,
        verb: str,
        group: str,
        resource: str,
        namespace: str | None,
        name: str | None = None,
    ) -> bool:
        sub, _, subresource = resource.partition("/")
        review = k8s.V1SubjectAccessReview(
            spec=k8s.V1SubjectAccessReviewSpec(
                user=user,
                groups=[
                    "system:serviceaccounts",
                    f"system:serviceaccounts:{user.split(':')[2]}",
                    "system:authenticated",
                ],
                resource_attributes=k8s.V1ResourceAttributes(
                    verb=verb,
                    group=group,
                    resource=sub,
                    subresource=subresource or None,
                    namespace=namespace,
                    name=name,
                ),
            )
        )
        return bool(self.api.create_subject_access_review(review).status.allowed)

    def expect(self, want: bool, user: str, *what: Any) -> str | None:
        """One review; a description of it when the answer was not ``want``."""
        got = self.allowed(user, *what)
        if got == want:
            self.count["allowed" if want else "denied"] += 1
            return None
        return f"{user} {'may' if got else 'may not'} {what}"

    def exactly(self, user: str, rules: set[Rule], namespace: str) -> list[str | None]:
        """Every verb on every resource the rules name: allowed iff a rule grants it."""
        out = []
        for group, resource in sorted({(g, r) for g, r, _ in rules}):
            ns = None if group == "apiextensions.k8s.io" else namespace  # cluster-scoped
            for verb in VERBS:
                out.append(self.expect((group, resource, verb) in rules, user, verb, group,
                                       resource, ns))  # fmt: skip
        return out

    def never(self, user: str, namespace: str | None) -> list[str | None]:
        return [
            self.expect(False, user, verb, group, resource, namespace)
            for group, resource, verbs in FORBIDDEN
            for verb in verbs
        ]


@pytest.fixture(scope="module")
def reviews(control_plane: ControlPlane) -> Iterator[Reviews]:
    plane = control_plane
    for namespace in (WIDE_NS, NARROW_NS, WATCHED, OTHER):
        plane.kubectl("create", "namespace", namespace)
    objects = [
        *render("rbac-wide", WIDE_NS),
        *render("rbac-narrow", NARROW_NS, "--set", f"watchNamespaces={{{WATCHED}}}"),
        *router_objects(),
    ]
    listed = yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": objects})
    plane.kubectl("apply", "-f", "-", input=listed)
    api_client = k8s_config.new_client_from_config(config_file=str(plane.kubeconfig))
    out = Reviews(k8s.AuthorizationV1Api(api_client))
    try:
        yield out
    finally:
        print(f"\nSubjectAccessReviews answered as expected: {dict(out.count)}")
        plane.kubectl("delete", "-f", "-", "--wait=false", input=listed, check=False)
        for namespace in (WIDE_NS, NARROW_NS, WATCHED, OTHER):
            plane.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
        api_client.close()


def account(namespace: str, name: str) -> str:
    return f"system:serviceaccount:{namespace}:{name}"


def failures(checks: list[str | None]) -> list[str]:
    return [c for c in checks if c]


def test_cluster_wide_operator_may_do_exactly_what_it_uses(reviews: Reviews) -> None:
    user = account(WIDE_NS, "rbac-wide-dpserve")
    eventually(lambda: reviews.allowed(user, "list", "", "pods", OTHER), what="the bindings")
    checks = reviews.exactly(user, required_rules(cluster_wide=True), OTHER)
    checks += reviews.never(user, OTHER)
    # Not even the Secret it made (create-only: a 409 tells it the Secret is there).
    checks.append(reviews.expect(False, user, "get", "", "secrets", OTHER, "tiny-wire"))
    assert failures(checks) == []


def test_namespaced_operator_reaches_nothing_outside_its_namespaces(reviews: Reviews) -> None:
    user = account(NARROW_NS, "rbac-narrow-dpserve")
    eventually(lambda: reviews.allowed(user, "list", "", "pods", WATCHED), what="the bindings")
    rules = required_rules(cluster_wide=False)
    checks = reviews.exactly(user, rules, WATCHED) + reviews.never(user, WATCHED)
    # Outside the watched namespace (kube-system's ConfigMaps too): not a single verb.
    for namespace in (OTHER, "kube-system"):
        for group, resource in sorted({(g, r) for g, r, _ in rules}):
            for verb in VERBS:
                checks.append(reviews.expect(False, user, verb, group, resource, namespace))
    # Nothing cluster-scoped and nothing across all namespaces.
    for verb in ("get", "list", "watch"):
        crds = ("apiextensions.k8s.io", "customresourcedefinitions")
        checks.append(reviews.expect(False, user, verb, *crds, None))
        for resource in ("namespaces", "pods", "configmaps", "secrets"):
            checks.append(reviews.expect(False, user, verb, "", resource, None))
    assert failures(checks) == []


def test_router_may_read_its_slices_and_keep_its_own_configmap_only(reviews: Reviews) -> None:
    user = account(WATCHED, b.router_name(SVC))
    slices = ("discovery.k8s.io", "endpointslices")
    state = b.control_state_name(SVC)
    eventually(lambda: reviews.allowed(user, "list", *slices, WATCHED), what="the router's Role")
    checks: list[str | None] = []
    for verb in VERBS:
        checks.append(reviews.expect(verb in ("list", "watch"), user, verb, *slices, WATCHED))
        checks.append(reviews.expect(False, user, verb, *slices, OTHER))
        own = verb in ("get", "update")
        checks.append(reviews.expect(own, user, verb, "", "configmaps", WATCHED, state))
        checks.append(reviews.expect(False, user, verb, "", "configmaps", WATCHED, "other"))
        checks.append(reviews.expect(False, user, verb, "", "configmaps", OTHER, state))
        for resource in ("secrets", "pods", "services"):
            checks.append(reviews.expect(False, user, verb, "", resource, WATCHED))
    checks.append(reviews.expect(False, user, "list", "", "configmaps", WATCHED))
    checks.append(reviews.expect(False, user, "get", "", "secrets", WATCHED, "tiny-wire"))
    assert failures(checks) == []
