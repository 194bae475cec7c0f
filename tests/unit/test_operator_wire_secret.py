"""A wire Secret the operator did not create is refused, reported and never mounted.

The operator may create Secrets and nothing more, so it knows its own wire Secret by
having created it (recorded in ``status.wireSecret``). The reconcile runs here against
an in-memory API (objects by kind and name, merge-patched status): the assertions are
on what exists afterwards, never on which calls were made. The same journey on a real
apiserver: tests/integration/test_operator_apiserver.py.
"""

from __future__ import annotations

import asyncio
import copy
from typing import Any, cast

from dpserve.operator import builders as b
from dpserve.operator import handlers as h
from dpserve.operator import wire
from dpserve.operator.kube import Kube

NS, NAME = "team", "qwen"
SECRET = f"{NAME}-wire"
IMAGES = b.Images(worker="reg/dpserve-worker:1", router="reg/dpserve-router:1")


def _merge(into: dict[str, Any], patch: dict[str, Any]) -> None:
    """A JSON merge patch (RFC 7386), as the apiserver applies one to status."""
    for key, value in patch.items():
        if value is None:
            into.pop(key, None)
        elif isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = copy.deepcopy(value)


class MemoryApi:
    """The calls a reconcile makes, over objects held in memory."""

    def __init__(self, status: dict[str, Any] | None = None) -> None:
        self.service: dict[str, Any] = {
            "apiVersion": "dpserve.dev/v1alpha1",
            "kind": "DiffusionService",
            "metadata": {"name": NAME, "namespace": NS, "uid": "uid-1", "generation": 1},
            "spec": {"model": {"path": "/models/tiny"}, "replicas": 1},
            "status": status or {},
        }
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.events: list[dict[str, Any]] = []

    async def get_service(self, namespace: str, name: str) -> dict[str, Any]:
        return copy.deepcopy(self.service)

    async def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        _merge(self.service.setdefault("status", {}), status)

    async def create_if_absent(self, obj: dict[str, Any]) -> bool:
        key = (obj["kind"], obj["metadata"]["name"])
        if key in self.objects:
            return False
        self.objects[key] = obj
        return True

    create_pod = create_if_absent

    async def apply(self, obj: dict[str, Any]) -> None:
        self.objects[(obj["kind"], obj["metadata"]["name"])] = obj

    async def list_pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        return [o for (kind, _), o in self.objects.items() if kind == "Pod"]

    async def get_deployment(self, namespace: str, name: str) -> None:
        return None

    async def get_configmap(self, namespace: str, name: str) -> None:
        return None

    async def create_event(self, event: dict[str, Any]) -> None:
        self.events.append(event)

    def kinds(self) -> set[str]:
        return {kind for kind, _ in self.objects}

    def degraded(self) -> dict[str, Any]:
        conditions = self.service["status"].get("conditions") or []
        return next(c for c in conditions if c["type"] == "Degraded")


def _reconcile(api: MemoryApi) -> None:
    runtime = h.Runtime(cast(Kube, api), IMAGES)
    asyncio.run(h.reconcile(runtime, NS, NAME))


def _planted() -> dict[str, Any]:
    """A Secret of the wire key's name that someone else made, with a key they know."""
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": SECRET, "namespace": NS}}


def test_ownership_is_known_from_the_create_or_its_record() -> None:
    assert wire.owned(SECRET, created=True, previous={})
    assert wire.owned(SECRET, created=False, previous={"wireSecret": SECRET})
    # Reconciled by an operator from before the record: it made the Secret then.
    assert wire.owned(SECRET, created=False, previous={"selector": "app=x", "replicas": 1})
    # Never created by this operator: a fresh service, or one whose only status is a refusal.
    assert not wire.owned(SECRET, created=False, previous={})
    assert not wire.owned(SECRET, created=False, previous={"observedGeneration": 1})
    assert not wire.owned(SECRET, created=False, previous={"wireSecret": "other-wire"})


def test_a_planted_wire_secret_is_refused_reported_and_never_mounted() -> None:
    api = MemoryApi()
    api.objects[("Secret", SECRET)] = _planted()
    _reconcile(api)
    assert api.kinds() == {"Secret"} and api.objects[("Secret", SECRET)] == _planted()
    degraded = api.degraded()
    assert (degraded["status"], degraded["reason"]) == ("True", wire.REFUSED)
    assert f"kubectl -n {NS} delete secret {SECRET}" in degraded["message"]
    assert "wireSecret" not in api.service["status"]
    assert [(e["type"], e["reason"]) for e in api.events] == [("Warning", wire.REFUSED)]
    _reconcile(api)  # the drift check again: no second Event, still nothing built
    assert len(api.events) == 1 and api.kinds() == {"Secret"}

    del api.objects[("Secret", SECRET)]  # what the message says to do
    _reconcile(api)
    made = api.objects[("Secret", SECRET)]
    assert made["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert api.service["status"]["wireSecret"] == SECRET
    assert {"Pod", "Deployment", "Service"} <= api.kinds()
    assert api.degraded()["reason"] != wire.REFUSED


def test_its_own_secret_is_kept_across_reconciles_and_operator_upgrades() -> None:
    api = MemoryApi()
    _reconcile(api)
    first = api.objects[("Secret", SECRET)]
    assert api.service["status"]["wireSecret"] == SECRET
    _reconcile(api)  # a restarted operator (no memory of what it applied): 409, recorded
    assert api.objects[("Secret", SECRET)] is first
    assert wire.REFUSED not in {e["reason"] for e in api.events}

    # A service an older operator reconciled (full status, no record) keeps its key.
    older = MemoryApi(status={"selector": "app.kubernetes.io/instance=qwen", "replicas": 1})
    older.objects[("Secret", SECRET)] = first
    _reconcile(older)
    assert older.objects[("Secret", SECRET)] is first
    assert older.service["status"]["wireSecret"] == SECRET and "Pod" in older.kinds()
