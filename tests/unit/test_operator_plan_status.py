"""The replica planner, the events it explains, and the status reported, on plain data."""

from __future__ import annotations

import json
from typing import Any

from dpserve.operator import builders as b
from dpserve.operator.plan import PodView, plan, why_create, why_delete
from dpserve.operator.spec import DiffusionServiceSpec
from dpserve.operator.status import (
    POD_REFUSED,
    available_condition,
    compute_status,
    known_indices,
    parse_control_state,
    router_available,
)

NEW, OLD = "new", "old"


def pod(index: int, spec_hash: str = NEW, ready: bool = True, deleting: bool = False) -> PodView:
    return PodView(f"x-replica-{index}", index, spec_hash, ready, deleting)


def test_scale_up_creates_missing_indices() -> None:
    assert plan(3, NEW, 1, 0, [pod(0)]).create == (1, 2)
    assert plan(3, NEW, 1, 0, []).create == (0, 1, 2)


def test_scale_down_deletes_the_highest_indices() -> None:
    result = plan(1, NEW, 1, 0, [pod(0), pod(1), pod(2)])
    assert result.delete == ("x-replica-2", "x-replica-1") and result.create == ()
    assert plan(0, NEW, 1, 0, [pod(0)]).delete == ("x-replica-0",)


def test_pod_loss_is_recreated_under_the_same_name() -> None:
    assert plan(3, NEW, 1, 0, [pod(0), pod(2)]).create == (1,)
    # Still terminating: the name is taken, wait for it to go.
    assert plan(3, NEW, 1, 0, [pod(0), pod(1, deleting=True), pod(2)]).empty


def test_roll_replaces_one_at_a_time_each_ready_before_the_next() -> None:
    pods = [pod(0, OLD), pod(1, OLD), pod(2, OLD)]
    first = plan(3, NEW, 1, 0, pods)
    assert first.delete == ("x-replica-2",) and first.create == ()
    # While the replacement is missing or unready, nothing else goes.
    gone = [pod(0, OLD), pod(1, OLD)]
    assert plan(3, NEW, 1, 0, gone).create == (2,) and plan(3, NEW, 1, 0, gone).delete == ()
    starting = [pod(0, OLD), pod(1, OLD), pod(2, NEW, ready=False)]
    assert plan(3, NEW, 1, 0, starting).empty
    ready = [pod(0, OLD), pod(1, OLD), pod(2, NEW)]
    assert plan(3, NEW, 1, 0, ready).delete == ("x-replica-1",)


def test_unready_outdated_pods_go_first_and_do_not_use_the_budget() -> None:
    pods = [pod(0, OLD), pod(1, OLD, ready=False), pod(2, OLD, ready=False)]
    # The unready ones go at once; the only ready one stays (availability is already low).
    assert plan(3, NEW, 1, 0, pods).delete == ("x-replica-2", "x-replica-1")
    healthy_budget = plan(3, NEW, 2, 0, [pod(i, OLD) for i in range(3)])
    assert healthy_budget.delete == ("x-replica-2", "x-replica-1")


def test_surge_adds_a_pod_past_replicas_and_never_exceeds_the_gpu_cap() -> None:
    pods = [pod(0, OLD), pod(1, OLD)]
    first = plan(2, NEW, 0, 1, pods)
    assert first.create == (2,) and first.delete == ()
    surged = [pod(0, OLD), pod(1, OLD), pod(2, NEW)]
    assert plan(2, NEW, 0, 1, surged).delete == ("x-replica-1",)
    for state in (pods, surged, [pod(0, OLD), pod(2, NEW)]):
        result = plan(2, NEW, 0, 1, state)
        assert len(state) - len(result.delete) + len(result.create) <= 2 + 1
    # Once nothing is outdated, the surge pod is excess and goes.
    assert plan(2, NEW, 0, 1, [pod(0), pod(1), pod(2)]).delete == ("x-replica-2",)


def test_a_surge_pod_stays_until_the_replacements_keep_the_budget() -> None:
    # Found by killing the operator mid-roll: nothing was outdated any more, so the
    # serving surge pod went while two replacements were still starting (1 of 3 ready).
    starting = [pod(0, ready=False), pod(1, ready=False), pod(2), pod(3)]
    assert plan(3, NEW, 1, 1, starting).empty
    one_up = [pod(0), pod(1, ready=False), pod(2), pod(3)]
    assert plan(3, NEW, 1, 1, one_up).delete == ("x-replica-3",)
    # A surge pod that does not serve helps nobody.
    assert plan(3, NEW, 1, 1, [*starting[:3], pod(3, ready=False)]).delete == ("x-replica-3",)
    # A plain scale-down is not held back by the surge allowance.
    assert plan(3, NEW, 1, 1, [pod(i) for i in range(5)]).delete == ("x-replica-4", "x-replica-3")


def _svc(replicas: int = 2) -> b.Svc:
    spec = DiffusionServiceSpec.model_validate({"model": {"path": "/m"}, "replicas": replicas})
    return b.Svc("x", "ns", "u", 5, spec)


def _pod(index: int, svc: b.Svc, ready: bool, **status: Any) -> dict[str, Any]:
    return {
        "metadata": {
            "name": f"x-replica-{index}",
            "labels": {b.REPLICA_LABEL: str(index)},
            "annotations": {b.SPEC_HASH: b.spec_hash(svc.spec)},
        },
        "spec": {"nodeName": "node-a"} if ready else {},
        "status": {
            "phase": "Running" if ready else "Pending",
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
            "podIP": f"10.244.0.{10 + index}",
            **status,
        },
    }


def _router(available: int, replicas: int = 1) -> dict[str, Any]:
    return {"spec": {"replicas": replicas}, "status": {"availableReplicas": available}}


ROUTER_UP = _router(1)


def _conditions(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in status["conditions"]}


def test_status_ready_and_stable() -> None:
    svc = _svc()
    status = compute_status(svc, [_pod(0, svc, True), _pod(1, svc, True)], {}, router=ROUTER_UP)
    assert status["readyReplicas"] == 2 and status["updatedReplicas"] == 2
    assert status["ready"] == "2/2" and status["observedGeneration"] == 5
    assert status["selector"] == (
        "app.kubernetes.io/name=dpserve,app.kubernetes.io/instance=x,"
        "app.kubernetes.io/component=replica"
    )
    conditions = _conditions(status)
    assert conditions["Ready"]["status"] == "True"
    assert conditions["Ready"]["reason"] == "AllReplicasReady"
    assert conditions["Progressing"]["status"] == "False"
    assert conditions["Degraded"]["status"] == "False"
    assert conditions["ControlStateSynced"]["status"] == "True"
    assert conditions["ControlStateSynced"]["reason"] == "InSync"
    assert all(c["observedGeneration"] == 5 for c in status["conditions"])
    assert status["replicaStatuses"][0]["node"] == "node-a"


def test_unschedulable_replica_is_degraded_with_the_schedulers_reason() -> None:
    svc = _svc()
    message = "0/1 nodes are available: 1 Insufficient nvidia.com/gpu."
    stuck = _pod(1, svc, False)
    stuck["status"]["conditions"].append(
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message}
    )
    status = compute_status(svc, [_pod(0, svc, True), stuck], {})
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "Unschedulable"
    assert message in degraded["message"]
    assert status["replicaStatuses"][1]["reason"] == "Unschedulable"
    assert status["ready"] == "1/2"


def test_a_spread_or_anti_affinity_refusal_shows_the_schedulers_message() -> None:
    # The scheduler's own words, whatever it refused on (a GPU shortage above; here
    # onePerNode's anti-affinity or a DoNotSchedule spread on too few nodes).
    svc = _svc()
    message = (
        "0/2 nodes are available: 1 node(s) didn't match pod anti-affinity rules, 1 node(s) "
        "didn't match pod topology spread constraints. preemption: 0/2 nodes are available: "
        "2 No preemption victims found for incoming pod."
    )
    stuck = _pod(1, svc, False)
    stuck["status"]["conditions"].append(
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message}
    )
    status = compute_status(svc, [_pod(0, svc, True), stuck], {})
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == "Unschedulable" and message in degraded["message"]
    assert status["replicaStatuses"][1]["message"] == message


def test_a_pod_the_apiserver_refused_is_listed_with_its_message() -> None:
    svc = _svc()
    message = 'pods "qwen-replica-1" is forbidden: no PriorityClass with name gpu-high was found'
    status = compute_status(svc, [_pod(0, svc, True)], {}, refused={1: message, 5: "gone"})
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == POD_REFUSED
    assert message in degraded["message"]
    replica = status["replicaStatuses"][1]
    assert (replica["phase"], replica["reason"], replica["message"]) == (
        "Missing",
        POD_REFUSED,
        message,
    )
    assert len(status["replicaStatuses"]) == 2  # a surge index is in Degraded only
    assert "x-replica-5: PodCreateRefused: gone" in degraded["message"]
    assert status["ready"] == "1/2"


def test_crash_looping_replica_and_transition_times_are_kept() -> None:
    svc = _svc(1)
    crashing = _pod(0, svc, False)
    waiting = {"reason": "CrashLoopBackOff", "message": "back-off 10s"}
    crashing["status"]["containerStatuses"] = [{"state": {"waiting": waiting}}]
    first = compute_status(svc, [crashing], {})
    degraded = next(c for c in first["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == "CrashLoopBackOff"
    old = {"conditions": [{**degraded, "lastTransitionTime": "2020-01-01T00:00:00Z"}]}
    again = compute_status(svc, [crashing], old)
    kept = next(c for c in again["conditions"] if c["type"] == "Degraded")
    assert kept["lastTransitionTime"] == "2020-01-01T00:00:00Z"


def test_a_crash_loop_reports_why_the_worker_exited() -> None:
    svc = _svc(1)
    crashing = _pod(0, svc, False)
    refusal = "replica 0: attention heads (24) must be divisible by ulysses * tp (16)\n"
    crashing["status"]["containerStatuses"] = [
        {
            "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s"}},
            "lastState": {"terminated": {"exitCode": 2, "message": refusal}},
        }
    ]
    status = compute_status(svc, [crashing], {})
    replica = status["replicaStatuses"][0]
    assert replica["reason"] == "CrashLoopBackOff"
    assert replica["message"] == refusal.strip().replace("replica 0", "exit code 2: replica 0")
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert "divisible by ulysses * tp (16)" in degraded["message"]


def test_ready_needs_the_router_available_not_only_the_replicas() -> None:
    svc = _svc()
    pods = [_pod(0, svc, True), _pod(1, svc, True)]
    for router, says in [(None, "does not exist"), (_router(0, 2), "router 0/2 available")]:
        status = compute_status(svc, pods, {}, router=router)
        ready = _conditions(status)["Ready"]
        assert (ready["status"], ready["reason"]) == ("False", "RouterNotAvailable")
        assert says in ready["message"] and "2/2 replicas ready" in ready["message"]
        assert status["readyReplicas"] == 2  # the replicas themselves are fine
    # One available router pod is enough to serve (each passes /ready only with a replica).
    assert router_available(_router(1, 3)) == (True, "router 1/3 available")
    # Replicas not ready take precedence in the reason: they are what is missing most.
    status = compute_status(svc, [pods[0], _pod(1, svc, False)], {}, router=None)
    assert _conditions(status)["Ready"]["reason"] == "ReplicasNotReady"


def test_available_holds_while_no_more_replicas_are_down_than_the_budget() -> None:
    """A drain takes one replica of two (the budget, maxUnavailable 1): Ready goes False,
    Available stays True; with none ready, or no router, it goes False too."""
    svc = _svc()
    one_down = compute_status(svc, [_pod(0, svc, True), _pod(1, svc, False)], {}, router=ROUTER_UP)
    conditions = _conditions(one_down)
    assert conditions["Ready"]["status"] == "False"
    available = conditions["Available"]
    assert (available["status"], available["reason"]) == ("True", "MinimumReplicasAvailable")
    assert available["message"] == "1/2 replicas ready, 1 needed; router 1/1 available"

    none_ready = [_pod(0, svc, False), _pod(1, svc, False)]
    available = _conditions(compute_status(svc, none_ready, {}, router=ROUTER_UP))["Available"]
    assert (available["status"], available["reason"]) == ("False", "MinimumReplicasUnavailable")
    routerless = [_pod(0, svc, True), _pod(1, svc, True)]
    available = _conditions(compute_status(svc, routerless, {}, router=None))["Available"]
    assert (available["status"], available["reason"]) == ("False", "RouterNotAvailable")


def test_the_replicas_available_needs_follow_the_disruption_budget() -> None:
    # Four replicas with a roll of two at a time: the budget is 2, so 2 ready suffice.
    assert available_condition(2, 2, 4, True, "router 1/1 available")[0] == "True"
    assert available_condition(1, 2, 4, True, "router 1/1 available")[0] == "False"
    # One replica: its budget of 1 would allow none; at least one must serve.
    assert available_condition(0, 1, 1, True, "router 1/1 available")[0] == "False"
    assert available_condition(1, 1, 1, True, "router 1/1 available")[0] == "True"
    # Scaled to 0: nothing serves, so not available (as not Ready).
    assert available_condition(0, 1, 0, True, "router 1/1 available")[0] == "False"


def _control(replicas: Any) -> dict[str, Any]:
    raw = replicas if isinstance(replicas, str) else json.dumps(replicas)
    return {"data": {"state": "{}", "replicas": raw}}


def test_a_replica_out_of_sync_is_reported_and_not_counted_ready() -> None:
    svc = _svc()
    pods = [_pod(0, svc, True), _pod(1, svc, True)]
    lagging = {
        "tcp://10.244.0.11:5575": {
            "reason": "set_lora failed: no such adapter",
            "since": 1796126400.5,
            "router": "x-router-abc",
        },
        # A pod that is gone (another address): stale, ignored.
        "tcp://10.244.0.99:5575": {"reason": "old", "since": 1.0, "router": "x-router-abc"},
        # A pod that is not Ready: routers do not follow it, so the entry is stale too.
        "tcp://10.244.0.12:5575": {"reason": "older", "since": 1.0, "router": "x-router-abc"},
    }
    control = parse_control_state(_control(lagging))
    status = compute_status(
        svc, [*pods, _pod(2, svc, False)], {}, router=ROUTER_UP, control=control
    )
    one = status["replicaStatuses"][1]
    assert (one["reason"], one["ready"]) == ("OutOfSync", False)
    assert one["message"] == (
        "set_lora failed: no such adapter (router x-router-abc since 2026-12-01T12:00:00Z)"
    )
    assert "reason" not in status["replicaStatuses"][0]
    assert status["readyReplicas"] == 1 and status["ready"] == "1/2"
    conditions = _conditions(status)
    synced = conditions["ControlStateSynced"]
    assert (synced["status"], synced["reason"]) == ("False", "OutOfSync")
    assert synced["message"].startswith("replica 1: set_lora failed: no such adapter")
    assert "replica 0" not in synced["message"] and "old" not in synced["message"]
    assert status["replicaStatuses"][2].get("reason") != "OutOfSync"
    assert (conditions["Ready"]["status"], conditions["Ready"]["reason"]) == (
        "False",
        "ReplicasNotReady",
    )
    assert conditions["Degraded"]["status"] == "False"  # it runs; it only lags


def test_a_malformed_control_state_is_ignored_not_fatal() -> None:
    svc = _svc()
    pods = [_pod(0, svc, True), _pod(1, svc, True)]
    for raw in ["{not json", "[1, 2]", '"text"']:
        control = parse_control_state(_control(raw))
        assert control.problem and not control.out_of_sync
        status = compute_status(svc, pods, {}, router=ROUTER_UP, control=control)
        conditions = _conditions(status)
        synced = conditions["ControlStateSynced"]
        assert (synced["status"], synced["reason"]) == ("Unknown", "ControlStateUnreadable")
        assert conditions["Ready"]["status"] == "True"
    # Odd entries are tolerated field by field; an absent key or ConfigMap is "in sync".
    odd = parse_control_state(
        _control(
            '{"tcp://10.244.0.10:5575": "lagging",'
            ' "tcp://10.244.0.11:5575": {"reason": 7, "since": Infinity, "router": null}}'
        )
    )
    assert odd.out_of_sync["tcp://10.244.0.10:5575"].reason == "out of sync"
    assert odd.out_of_sync["tcp://10.244.0.11:5575"].describe() == "7 (router ?)"
    status = compute_status(svc, pods, {}, router=ROUTER_UP, control=odd)
    assert status["replicaStatuses"][1]["message"] == "7 (router ?)"
    assert parse_control_state(None).out_of_sync == {} and parse_control_state(None).problem is None
    assert parse_control_state({"data": None}).problem is None


def test_a_missing_desired_replica_is_listed_so_its_recreation_is_a_replacement() -> None:
    svc = _svc(3)
    status = compute_status(svc, [_pod(0, svc, True), _pod(2, svc, True)], {}, router=ROUTER_UP)
    missing = status["replicaStatuses"][1]
    assert missing == {
        "index": 1,
        "pod": "x-replica-1",
        "phase": "Missing",
        "ready": False,
        "updated": False,
    }
    assert status["replicas"] == 2  # what exists, for the scale subresource
    assert known_indices(status) == {0, 1, 2}
    assert why_create(1, "x-replica-1", 3, known_indices(status)).reason == "ReplicaReplaced"


def test_each_action_is_explained() -> None:
    rolled = why_delete(pod(1, OLD), replicas=3)
    assert rolled.reason == "ReplicaRolled" and "x-replica-1" in rolled.message
    scaled = why_delete(pod(3), replicas=3)
    assert scaled.reason == "ReplicaDeleted" and "x-replica-3" in scaled.message
    created = why_create(2, "x-replica-2", 3, known={0, 1})
    assert created.reason == "ReplicaCreated" and "x-replica-2 (replica 2)" in created.message
    surge = why_create(3, "x-replica-3", 3, known={0, 1, 2})
    assert surge.reason == "ReplicaCreated" and "surge" in surge.message
    assert why_create(1, "x-replica-1", 3, known={0, 1, 2}).reason == "ReplicaReplaced"
