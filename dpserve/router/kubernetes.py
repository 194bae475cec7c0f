"""The router in Kubernetes: replicas from EndpointSlices, the control state in a ConfigMap.

Discovery watches the EndpointSlices of the replicas' headless Service. Only
endpoints that are ready and not terminating become replicas, so a replica
that is scaled down or deleted stops receiving traffic while it drains. The
watch restarts with a full re-list every ``relist_s`` seconds, so a missed event
can never leave a stale endpoint behind.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException

from dpserve.contract.control_state import StateDoc, parse_doc, stored_after
from dpserve.contract.layout import replica_endpoint

log = logging.getLogger(__name__)
SERVICE_LABEL = "kubernetes.io/service-name"
T = TypeVar("T")


def ready_endpoints(slices: list[dict[str, Any]], port_name: str = "zmq") -> set[str]:
    """``tcp://ip:port`` of every ready, non-terminating endpoint in these slices."""
    out = set()
    for eps in slices:
        ports = [p for p in eps.get("ports") or [] if p.get("port")]
        port = next((p["port"] for p in ports if p.get("name") == port_name), None)
        if port is None and ports:
            port = ports[0]["port"]
        if port is None:
            continue
        for endpoint in eps.get("endpoints") or []:
            cond = endpoint.get("conditions") or {}
            # The API says an unset `ready` means ready; `terminating` unset means not.
            if cond.get("ready") is False or cond.get("terminating") is True:
                continue
            for address in endpoint.get("addresses") or []:
                out.add(replica_endpoint(address, port, 0))
    return out


class EndpointSliceDiscovery:
    """Feeds ``on_change`` the replica endpoints behind one Service, from a thread."""

    def __init__(
        self,
        namespace: str,
        service: str,
        on_change: Callable[[set[str]], Coroutine[Any, Any, None]],
        relist_s: float = 30.0,
    ) -> None:
        self.namespace = namespace
        self.service = service
        self.on_change = on_change
        self.relist_s = relist_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watch: watch.Watch | None = None

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        await self._publish(await asyncio.to_thread(self._list))
        self._thread = threading.Thread(target=self._run, name="endpointslices", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 5)

    def _api(self) -> client.DiscoveryV1Api:
        return client.DiscoveryV1Api()

    def _list(self) -> tuple[dict[str, dict[str, Any]], str]:
        listed = self._api().list_namespaced_endpoint_slice(
            self.namespace, label_selector=f"{SERVICE_LABEL}={self.service}"
        )
        raw: dict[str, Any] = client.ApiClient().sanitize_for_serialization(listed)
        slices = {item["metadata"]["name"]: item for item in raw.get("items") or []}
        return slices, str(raw["metadata"]["resourceVersion"])

    async def _publish(self, listed: tuple[dict[str, dict[str, Any]], str]) -> None:
        await self.on_change(ready_endpoints(list(listed[0].values())))

    def _submit(self, slices: dict[str, dict[str, Any]]) -> None:
        assert self._loop is not None
        endpoints = ready_endpoints(list(slices.values()))
        future = asyncio.run_coroutine_threadsafe(self.on_change(endpoints), self._loop)
        future.result(timeout=30)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                slices, version = self._list()
                self._submit(slices)
                self._watch = watch.Watch()
                stream = self._watch.stream(
                    self._api().list_namespaced_endpoint_slice,
                    self.namespace,
                    label_selector=f"{SERVICE_LABEL}={self.service}",
                    resource_version=version,
                    timeout_seconds=int(self.relist_s),
                )
                for event in stream:
                    obj = client.ApiClient().sanitize_for_serialization(event["object"])
                    name = obj["metadata"]["name"]
                    if event["type"] == "DELETED":
                        slices.pop(name, None)
                    elif event["type"] in ("ADDED", "MODIFIED"):
                        slices[name] = obj
                    self._submit(slices)
                    if self._stop.is_set():
                        break
            except Exception as exc:  # re-list after any failure (410 Gone included)
                if self._stop.is_set():
                    break
                log.warning("endpointslice watch failed (%s); re-listing", exc)
                self._stop.wait(1.0)


class ConfigMapStateStore:
    """The desired control state as JSON in a ConfigMap, moved forward with compare-and-swap.

    Key ``state`` holds the document; key ``replicas`` the replicas the routers
    find out of sync (endpoint -> reason, since, router), which the operator shows
    in the DiffusionService's status. A ConfigMap that is missing (deleted; the
    operator recreates it) or holds something unreadable is treated as empty: the
    replicas' own reports and this router's memory carry the state meanwhile.
    """

    STATE = "state"
    REPLICAS = "replicas"

    def __init__(self, namespace: str, name: str, router: str = "", attempts: int = 20) -> None:
        self.namespace = namespace
        self.name = name
        self.router = router or os.environ.get("HOSTNAME", "router")
        self.attempts = attempts

    def _api(self) -> client.CoreV1Api:
        return client.CoreV1Api()

    def _read(self) -> Any | None:
        try:
            return self._api().read_namespaced_config_map(self.name, self.namespace)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def _doc(self, cm: Any) -> StateDoc | None:
        raw = (cm.data or {}).get(self.STATE) if cm is not None else None
        if not raw:
            return None
        try:
            return parse_doc(json.loads(raw))
        except ValueError as exc:  # json.JSONDecodeError is a ValueError
            log.warning(
                "%s/%s: unreadable control state, ignored: %s", self.namespace, self.name, exc
            )
            return None

    def load(self) -> StateDoc | None:
        return self._doc(self._read())

    def advance(self, doc: StateDoc) -> StateDoc:
        def change(cm: Any) -> tuple[StateDoc, bool]:
            current = self._doc(cm)
            stored = stored_after(current, doc)
            if stored is doc:
                cm.data = {**(cm.data or {}), self.STATE: json.dumps(doc.to_builtins())}
            return stored, stored is doc and current != doc

        return self._swap(change, doc)

    def report(self, out_of_sync: dict[str, str], known: set[str]) -> None:
        def change(cm: Any) -> tuple[None, bool]:
            try:
                entries = dict(json.loads((cm.data or {}).get(self.REPLICAS) or "{}"))
            except (ValueError, TypeError):
                entries = {}
            # Ours to rewrite: the replicas this router knows; others' stay as they are.
            for endpoint in known:
                entries.pop(endpoint, None)
            now = time.time()
            for endpoint, reason in out_of_sync.items():
                entries[endpoint] = {"reason": reason, "since": now, "router": self.router}
            cm.data = {**(cm.data or {}), self.REPLICAS: json.dumps(entries, sort_keys=True)}
            return None, True

        self._swap(change, None)

    def _swap(self, change: Callable[[Any], tuple[T, bool]], missing: T) -> T:
        """Read, change, replace with the read's resourceVersion; re-read on a conflict.
        ``change`` says what to return and whether there is anything to write."""
        api = self._api()
        for _ in range(self.attempts):
            cm = self._read()
            if cm is None:
                log.warning(
                    "%s/%s is missing: control state kept in memory", self.namespace, self.name
                )
                return missing
            result, write = change(cm)
            if not write:
                return result
            try:
                api.replace_namespaced_config_map(self.name, self.namespace, cm)
            except ApiException as exc:
                if exc.status in (404, 409):
                    continue
                raise
            return result
        raise RuntimeError(f"control state {self.namespace}/{self.name}: too many write conflicts")
