"""What a request costs on a replica, and how much work waits there (dpserve.contract.cost).

:class:`Load` reads the replicas' calibrations and ledgers, and writes nothing: a
request's cost units come from its shape and the replica's defaults; its seconds
from the replica's measured seconds per unit, else the other replicas', else a
prior (dpserve/router/policies.py). Placement, the ``/health`` JSON, the metrics
and video jobs' bound all estimate here.
"""

from __future__ import annotations

import time

from dpserve.contract import protocol as p
from dpserve.contract.cost import cost_units
from dpserve.router.membership import Membership
from dpserve.router.policies import measured_seconds_per_unit, seconds_per_unit
from dpserve.router.replica import Replica


class Load:
    def __init__(self, members: Membership) -> None:
        self.members = members

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

    def outstanding_s(self, replica: Replica, now: float | None = None) -> float:
        """Estimated seconds of work queued and running there: this router's (the
        running one shrinking as it runs) and other routers' (as of the last ping)."""
        now = time.monotonic() if now is None else now
        others = replica.others_units * self.seconds_per_unit(replica)
        return replica.ledger.seconds(now) + others
