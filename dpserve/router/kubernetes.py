"""The router in Kubernetes: replicas from EndpointSlices, the control log in a ConfigMap.

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
import threading
from collections.abc import Callable, Coroutine
from typing import Any

from kubernetes import client, config, watch
from kubernetes.client.exceptions import ApiException

from dpserve.layout import replica_endpoint
from dpserve.router.control_log import Entries

log = logging.getLogger(__name__)
SERVICE_LABEL = "kubernetes.io/service-name"


def load_config() -> None:
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()


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


class ConfigMapLogStore:
    """The control log as JSON in a ConfigMap, updated with compare-and-swap.

    Every router replica reads and appends through the same object; a conflict
    (someone else wrote first) re-reads and re-applies the change.
    """

    KEY = "log"

    def __init__(self, namespace: str, name: str, attempts: int = 20) -> None:
        self.namespace = namespace
        self.name = name
        self.attempts = attempts

    def _api(self) -> client.CoreV1Api:
        return client.CoreV1Api()

    def load(self) -> Entries:
        cm = self._api().read_namespaced_config_map(self.name, self.namespace)
        return list(json.loads((cm.data or {}).get(self.KEY) or "[]"))

    def update(self, change: Callable[[Entries], Entries]) -> Entries:
        api = self._api()
        for _ in range(self.attempts):
            cm = api.read_namespaced_config_map(self.name, self.namespace)
            entries = change(list(json.loads((cm.data or {}).get(self.KEY) or "[]")))
            cm.data = {**(cm.data or {}), self.KEY: json.dumps(entries)}
            try:
                # metadata.resourceVersion makes this a compare-and-swap.
                api.replace_namespaced_config_map(self.name, self.namespace, cm)
            except ApiException as exc:
                if exc.status == 409:
                    continue
                raise
            return entries
        raise RuntimeError(f"control log {self.namespace}/{self.name}: too many write conflicts")
