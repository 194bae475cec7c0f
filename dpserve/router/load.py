"""What a request costs on a replica, and how much work waits there (dpserve.contract.cost).

:class:`Load` reads the replicas' calibrations and ledgers, and writes nothing: a
request's cost units come from its shape and the replica's defaults; its seconds
from the replica's measured seconds per unit, else the other replicas', else a
prior (dpserve/router/policies.py). Placement, the ``/health`` JSON, the metrics
and video jobs' bound all estimate here. Placement adds the load time of the
request's LoRA adapters a replica lacks (dpserve/router/adapters.py).
"""

from __future__ import annotations

import time

from dpserve.contract import protocol as p
from dpserve.contract.cost import cost_units
from dpserve.router.adapters import adapters_key, evicts, load_seconds, miss_seconds, missing
from dpserve.router.membership import Membership
from dpserve.router.policies import measured_seconds_per_unit, seconds_per_unit
from dpserve.router.replica import Replica


class Load:
    def __init__(self, members: Membership, aware: bool = True) -> None:
        self.members = members
        self.aware = aware  # count the load of adapters a replica lacks (docs/lora.md)

    def seconds_per_unit(self, replica: Replica) -> float:
        others = (r.cost.seconds_per_unit for r in self.members.members() if r is not replica)
        return seconds_per_unit(replica.cost.seconds_per_unit, others)

    def measured_seconds(self, replica: Replica, params: p.GenerateParams) -> float | None:
        """The request's estimated seconds on ``replica`` from measured seconds per unit
        (its own, else the others'); None while no replica has measured any."""
        others = (r.cost.seconds_per_unit for r in self.members.members() if r is not replica)
        spu = measured_seconds_per_unit(replica.cost.seconds_per_unit, others)
        return None if spu is None else cost_units(params, replica.cost) * spu

    def estimate(self, replica: Replica, params: p.GenerateParams) -> tuple[float, float]:
        """The request's cost units and estimated seconds on ``replica``."""
        units = cost_units(params, replica.cost)
        return units, units * self.seconds_per_unit(replica)

    def adapter_load_s(self, replica: Replica, params: p.GenerateParams) -> float:
        """Seconds ``replica`` would spend loading the request's adapters it lacks (not
        resident, and not on their way there with this router's requests); 0 when
        adapter-blind. The service's own adapters (no ``lora``) are on every replica.
        The work it adds there: what the ledger counts."""
        if not self.aware or not params.lora:
            return 0.0
        report = replica.adapters
        lacking = missing(params.lora, replica.trail.present(report.resident if report else ()))
        others = (
            r.adapters.load_s
            for r in self.members.members()
            if r is not replica and r.adapters is not None
        )
        return load_seconds(len(lacking), report.load_s if report else None, others)

    def miss_cost_s(self, replica: Replica, params: p.GenerateParams) -> float:
        """What placing the request there costs in adapter loads: :meth:`adapter_load_s`,
        twice into a full cache (:func:`miss_seconds`). Placement weighs this; the
        replica's queue only grows by the load itself."""
        seconds = self.adapter_load_s(replica, params)
        return miss_seconds(seconds, seconds > 0 and evicts(replica.adapters))

    def affinity(self, params: p.GenerateParams) -> str | None:
        """The key least work gathers the request's adapters by; None when it names none
        or routing is adapter-blind."""
        if not self.aware or not params.lora:
            return None
        return adapters_key(params.lora)

    def outstanding_s(self, replica: Replica, now: float | None = None) -> float:
        """Estimated seconds of work queued and running there: this router's (the
        running one shrinking as it runs) and other routers' (as of the last ping)."""
        now = time.monotonic() if now is None else now
        others = replica.others_units * self.seconds_per_unit(replica)
        return replica.ledger.seconds(now) + others
