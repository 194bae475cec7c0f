"""One replica as ``/health/replicas`` and ``/server_info`` show it (docs/router.md).

A pure builder: the pool (dpserve/router/pool.py) gathers what its parts know of
the replica (its cap, estimated work, calibration, and why it does not serve) and
this lays it out.
"""

from __future__ import annotations

import time
from typing import Any

from dpserve.router.replica import Replica


def replica_json(
    replica: Replica,
    *,
    max_in_flight: int,
    outstanding_s: float,
    seconds_per_unit: float,
    why_not: str | None,
) -> dict[str, Any]:
    """``why_not``: why it does not serve (None when it does)."""
    if replica.serving:
        state = "serving"
    elif not replica.answering:
        state = "down"
    else:
        state = "out_of_sync" if replica.sync_error else "syncing"
    held = replica.held
    return {
        "replica": replica.name,
        "endpoint": replica.endpoint,
        "state": state,
        "status": replica.status,
        "in_flight": replica.inflight,
        "max_in_flight": max_in_flight,
        "served": replica.served,
        "queue_depth": replica.queue_depth,
        "busy_fraction": replica.busy_fraction,
        "outstanding_work_s": round(outstanding_s, 3),
        "outstanding_units": {
            "this_router": round(replica.ledger.units, 4),
            "other_routers": round(replica.others_units, 4),
        },
        "calibration": {
            "seconds_per_unit": replica.cost.seconds_per_unit,
            "samples": replica.cost.samples,
            "used_seconds_per_unit": seconds_per_unit,
        },
        "control_state": {"version": held.version, "digest": held.state.digest()} if held else None,
        "sessions": replica.sessions,
        "max_sessions": replica.max_sessions,
        "session_bytes": replica.session_bytes,
        "adapters": _adapters(replica),
        "last_error": why_not,
        "last_seen_s_ago": round(time.monotonic() - replica.last_seen, 3)
        if replica.last_seen
        else None,
    }


def _adapters(replica: Replica) -> dict[str, Any] | None:
    """Its LoRA adapter cache as of its last ping (docs/lora.md); None without one."""
    report = replica.adapters
    if report is None:
        return None
    return {
        "resident": sorted(report.resident),
        "pinned": sorted(report.pinned),
        "used_bytes": report.used_bytes,
        "capacity_bytes": report.capacity_bytes,
        "load_s": report.load_s,
    }
