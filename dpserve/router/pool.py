"""The replicas behind a router, in parts with one owner each, composed here.

:class:`ReplicaPool` builds the parts, wires them, and runs their start and close;
callers use the part for their concern (``pool.admission.acquire``,
``pool.health.mark_failed``, ``pool.control.change``), and the pool itself answers
only what spans the parts: who is in the pool and serving, and the ``/health`` JSON.

- :class:`~dpserve.router.membership.Membership` (``pool.membership``): discovery's
  endpoints as connected replicas; leaving ones drain; the way to send to one.
- :class:`~dpserve.router.health.Health` (``pool.health``): one ping loop per
  replica (one slow or stopped replica never delays another's pings), what the pings
  report, and taking a failed replica out of rotation.
- :class:`~dpserve.router.control_plane.ControlPlane` (``pool.control``): the
  desired control state, one sync task per replica that does not hold it, the
  control ops, and whether each replica serves: it answers pings, reports ``ok``,
  and holds the desired control state.
- :class:`~dpserve.router.admission.Admission` (``pool.admission``): generation
  requests take a slot on a serving replica (the routing policy picks: least
  estimated work, or round-robin; at most ``max_inflight`` x the replica's batch
  size each) or wait in a bounded queue, served fairly between tenants; video jobs
  are placed at once, past the cap.
- :class:`~dpserve.router.load.Load` (``pool.load``): each request's estimated cost,
  so the pool knows every replica's outstanding work (dpserve.contract.cost, docs/router.md),
  and the load of the LoRA adapters it lacks (docs/lora.md).
- :class:`~dpserve.router.lora_names.LoraNames` (``pool.loras``): which path each
  adapter name stands for, so a request may name one alone.

Which part writes which field of a :class:`~dpserve.router.replica.Replica` is
written down in dpserve/router/replica.py.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import zmq.asyncio

from dpserve.config.router import AdapterRouting, PolicyName
from dpserve.config.router import default as option
from dpserve.plumbing.curve import WireKey, plaintext_warning
from dpserve.router.admission import Admission
from dpserve.router.control_plane import ControlPlane
from dpserve.router.desired import DesiredState
from dpserve.router.health import Health
from dpserve.router.load import Load
from dpserve.router.lora_names import LoraNames
from dpserve.router.membership import Membership
from dpserve.router.replica import Replica
from dpserve.router.replica_json import replica_json


@dataclass
class PoolSettings:
    """How the pool runs; the fields a command line sets default to ``RouterConfig``'s."""

    request_timeout_s: float = option("request_timeout")
    ping_interval_s: float = 1.0
    ping_timeout_s: float = 2.0
    # Pings are answered by the driver's socket thread even mid-generation, so this
    # many missed in a row means a stopped or hung process: it leaves rotation and
    # its in-flight requests are failed then (and retried elsewhere), not at the
    # request timeout. Fewer is more likely the router's own lag.
    abandon_after_missed_pings: int = 2
    control_timeout_s: float = 300.0
    sync_backoff_max_s: float = 30.0
    max_inflight: int = option("max_inflight_per_replica")  # times a replica's batch size
    policy: PolicyName = field(default=option("policy"))  # docs/router.md, Routing policies
    # Least work counts the load of adapters a replica lacks (docs/lora.md).
    adapter_routing: AdapterRouting = field(default=option("adapter_routing"))
    adapter_home_slack: float = option("adapter_home_slack")  # requests
    loras: dict[str, str] = field(default_factory=dict)  # --lora NAME=PATH
    max_queue: int = option("max_waiting")  # requests waiting for a slot, router-wide
    # Fair shares (docs/tenants.md): per tenant, requests in flight and waiting (0: no
    # cap); weights of the fair order (an unnamed tenant weighs 1).
    max_per_tenant: int = option("max_requests_per_tenant")
    tenant_weights: dict[str, int] = field(default_factory=dict)
    # The service's wire key: the router is a CURVE client of every driver with it.
    # None: plaintext (only for a wire nobody else can reach; warned at start).
    wire_key: WireKey | None = None


class ReplicaPool:
    def __init__(
        self,
        settings: PoolSettings,
        ctx: zmq.asyncio.Context | None = None,
        desired: DesiredState | None = None,
    ) -> None:
        self.settings = settings
        self.ctx = ctx if ctx is not None else zmq.asyncio.Context()
        self.membership = Membership(self.ctx, settings.wire_key, settings.request_timeout_s)
        self.load = Load(self.membership, aware=settings.adapter_routing == "aware")
        self.admission = Admission(
            self.membership,
            self.load,
            settings.policy,
            settings.max_inflight,
            settings.max_queue,
            settings.max_per_tenant,
            settings.tenant_weights,
            home_slack=settings.adapter_home_slack,
        )
        self.health = Health(
            self.membership,
            adopt=lambda held: self.control.adopt(held),
            settle=lambda replica: self.control.settle(replica),
            interval_s=settings.ping_interval_s,
            timeout_s=settings.ping_timeout_s,
            abandon_after=settings.abandon_after_missed_pings,
        )
        self.control = ControlPlane(
            self.membership,
            self.health,
            desired if desired is not None else DesiredState(),
            wake=self.admission.wake,
            timeout_s=settings.control_timeout_s,
            backoff_max_s=settings.sync_backoff_max_s,
            follow_s=settings.ping_interval_s,
        )
        self.loras = LoraNames(settings.loras, self.membership, lambda: self.control.desired.doc)
        self._started = False

    @property
    def replicas(self) -> dict[str, Replica]:
        return self.membership.replicas

    @property
    def desired(self) -> DesiredState:
        return self.control.desired

    def members(self) -> list[Replica]:
        return self.membership.members()

    def serving(self) -> list[Replica]:
        return self.membership.serving()

    async def set_endpoints(self, endpoints: Iterable[str]) -> None:
        """Discovery's view of the world: connect new replicas, drop vanished ones."""
        joined, left = self.membership.update(endpoints)
        for replica in left:
            self.health.stop(replica.endpoint)
            self.control.stop_sync(replica.endpoint)
        if self._started:
            for replica in joined:
                self.health.watch(replica)
        self.admission.wake()

    async def start(self) -> None:
        """Read the stored state and ask every replica once before anything serves, so
        the desired state is the newest anyone holds, not whichever replica answered first."""
        if self.settings.wire_key is None:
            plaintext_warning(
                "the router", "prompts and images cross the network in plaintext, unauthenticated"
            )
        with contextlib.suppress(Exception):  # an unreachable store: the replicas tell us
            await self.desired.refresh()
        await self.health.recheck(self.members())
        self._started = True
        for replica in self.members():
            self.health.watch(replica)
        self.control.start()

    async def close(self) -> None:
        # A drain's cleanup closes its connection.
        tasks = [*self.health.tasks(), *self.control.tasks(), *self.membership.tasks()]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.membership.close()

    def snapshot(self, replica: Replica) -> dict[str, Any]:
        """The replica as ``/health/replicas`` and ``/server_info`` show it."""
        return replica_json(
            replica,
            max_in_flight=self.admission.cap(replica),
            outstanding_s=self.load.outstanding_s(replica),
            seconds_per_unit=self.load.seconds_per_unit(replica),
            why_not=None if replica.serving else self.control.why_not(replica),
        )
