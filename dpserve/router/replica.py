"""One replica as the router sees it, and a generation's place on it.

A :class:`Replica` is a record: the parts of the pool (dpserve/router/pool.py) each
write their own fields and read the others'. Who writes what:

- :class:`~dpserve.router.membership.Membership` makes it (``endpoint``, ``conn``);
- :class:`~dpserve.router.health.Health` writes what its pings report (from
  ``replica_id`` to ``others_units``, ``answering``, ``missed_pings``,
  ``last_error``, ``info``, ``info_error``);
- :class:`~dpserve.router.control_plane.ControlPlane` writes what it holds after a
  control op (``held``, ``sync_error``) and derives ``serving`` from the rest;
- :class:`~dpserve.router.admission.Admission` writes this router's work there
  (``inflight``, ``ledger``, ``served``, the adapters in ``trail``) and corrects
  ``sessions`` between pings; health writes ``adapters`` and tells ``trail`` of pings.

Two shortcuts, both only ever taking a replica out of rotation at once, before the
control plane next judges it: membership clears ``serving`` and ``answering`` when
discovery drops a replica, and health when a replica fails a ping or a request.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from dpserve.contract import protocol as p
from dpserve.contract.control_state import StateDoc
from dpserve.contract.model_info import ModelInfo
from dpserve.router.adapters import AdapterTrail
from dpserve.router.connection import ReplicaConnection
from dpserve.router.policies import WorkLedger


@dataclass
class Replica:
    endpoint: str
    conn: ReplicaConnection
    replica_id: str = ""  # the worker's replica index, as it reports it
    boot_id: str = ""
    answering: bool = False
    serving: bool = False  # derived by the control plane from the fields below
    status: str = "unknown"
    held: StateDoc | None = None  # the control state it reports
    sync_error: str | None = None  # why it could not reach the desired state
    missed_pings: int = 0
    inflight: int = 0
    served: int = 0
    last_error: str | None = None
    last_seen: float = 0.0
    info: ModelInfo | None = None
    info_error: str | None = None  # why its model_info could not be read, if it could not
    sessions: int = 0  # realtime sessions it holds, as of its last ping
    max_sessions: int = 0
    session_bytes: int = 0
    # Load, as of its last ping, and this router's own work there (the cost model).
    max_batch: int = 1
    cost: p.CostReport = field(default_factory=p.CostReport)
    queue_depth: int = 0  # requests queued at the replica (every router's)
    busy_fraction: float = 0.0
    others_units: float = 0.0  # units there that are not this router's
    ledger: WorkLedger = field(default_factory=WorkLedger)
    # Its LoRA adapter cache, as of its last ping (None: a replica without one), and the
    # adapters of this router's requests there that the ping may not show yet.
    adapters: p.AdapterReport | None = None
    trail: AdapterTrail = field(default_factory=AdapterTrail)
    # One control conversation at a time, so a sync and a fan-out never interleave.
    control: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def full(self) -> bool:
        return 0 < self.max_sessions <= self.sessions

    @property
    def name(self) -> str:
        return self.replica_id or self.endpoint


@dataclass(frozen=True)
class Slot:
    """A generation's place on a replica, and its cost there, until
    :meth:`Admission.release <dpserve.router.admission.Admission.release>`."""

    replica: Replica
    ticket: int
    units: float
    seconds: float
    tenant: str | None = None  # whose per-tenant count it is in (None: a video job's)
    adapters: tuple[str, ...] = ()  # the request's LoRA adapters' names
