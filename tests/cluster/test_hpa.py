"""examples/autoscaling/hpa.yaml against a real kube-apiserver and kube-controller-manager.

No operator and no metrics adapter run. The HPA controller still reads the
DiffusionService's scale subresource (AbleToScale), writes spec.replicas through it when
the count is outside [minReplicas, maxReplicas], accepts the selector the operator writes
to status, then fails only on the External metric nobody serves; a service scaled to 0
is left alone (the HPA turns itself off at 0 replicas: docs/autoscaling.md).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from dpserve.operator import builders as b
from dpserve.operator.spec import DiffusionServiceSpec
from tests.cluster.controlplane import ControlPlane
from tests.polling import eventually

pytestmark = pytest.mark.cluster
REPO = Path(__file__).resolve().parents[2]
NS = "hpa-test"


def test_the_hpa_scales_a_diffusion_service_through_its_scale_subresource(
    control_plane: ControlPlane,
) -> None:
    plane = control_plane
    plane.kubectl("apply", "-f", str(REPO / "charts/dpserve/crds"))
    plane.kubectl("wait", "--for=condition=Established", "crd/diffusionservices.dpserve.dev")
    plane.kubectl("create", "namespace", NS)
    svc = yaml.safe_load((REPO / "examples/diffusionservice-gpu.yaml").read_text())
    hpa = yaml.safe_load((REPO / "examples/autoscaling/hpa.yaml").read_text())
    name, top = svc["metadata"]["name"], hpa["spec"]["maxReplicas"]
    svc["metadata"]["namespace"] = hpa["metadata"]["namespace"] = NS
    svc["spec"]["replicas"] = top + 4
    for obj in (svc, hpa):
        plane.kubectl("apply", "-f", "-", input=json.dumps(obj))

    def get(kind: str) -> Any:
        return json.loads(plane.kubectl("-n", NS, "get", kind, name, "-o", "json").stdout)

    def condition(kind: str) -> dict[str, Any]:
        conditions = get("hpa").get("status", {}).get("conditions", [])
        return next((c for c in conditions if c["type"] == kind), {})

    eventually(lambda: get("dsvc")["spec"]["replicas"] == top, what="the HPA's rescale")
    assert condition("AbleToScale")["status"] == "True"
    # The selector the operator writes to status (the scale subresource's labelSelectorPath).
    parsed = b.Svc(name, NS, "", 1, DiffusionServiceSpec.model_validate(svc["spec"]))
    status = {"status": {"replicas": top, "selector": b.selector_string(parsed)}}
    plane.kubectl("-n", NS, "patch", "dsvc", name, "--subresource=status", "--type=merge",
                  "-p", json.dumps(status))  # fmt: skip
    eventually(
        lambda: condition("ScalingActive").get("reason") == "FailedGetExternalMetric",
        what="the HPA asking for its External metric",
    )
    assert condition("AbleToScale")["status"] == "True"
    plane.kubectl("-n", NS, "scale", "dsvc", name, "--replicas=0")
    eventually(
        lambda: condition("ScalingActive").get("reason") == "ScalingDisabled",
        what="the HPA standing down at 0 replicas",
    )
    assert get("dsvc")["spec"]["replicas"] == 0
