"""The replica planner and the status it reports, on plain data."""

from __future__ import annotations

from typing import Any

from dpserve.operator import builders as b
from dpserve.operator.plan import PodView, plan
from dpserve.operator.spec import DiffusionServiceSpec
from dpserve.operator.status import compute_status

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
            **status,
        },
    }


def test_status_ready_and_stable() -> None:
    svc = _svc()
    status = compute_status(svc, [_pod(0, svc, True), _pod(1, svc, True)], {})
    assert status["readyReplicas"] == 2 and status["updatedReplicas"] == 2
    assert status["ready"] == "2/2" and status["observedGeneration"] == 5
    assert status["selector"] == (
        "app.kubernetes.io/name=dpserve,app.kubernetes.io/instance=x,"
        "app.kubernetes.io/component=replica"
    )
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["Ready"]["status"] == "True"
    assert conditions["Progressing"]["status"] == "False"
    assert conditions["Degraded"]["status"] == "False"
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
