"""examples/autoscaling/, checked against what they name: the router's real /metrics, the
labels the operator puts on router pods, Kubernetes' HPA schema, the DiffusionService CRD
and the fields KEDA's ScaledObject CRD and Prometheus scaler accept.

The router runs in-process against the benchmarks' stub driver (a real ZMQ driver that
answers at once) and is scraped as Prometheus would scrape it. The scrape job is checked
with a small model of Prometheus' pod discovery and relabelling (keep and replace only,
which is all the job uses) run on the pods the operator's builders make.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import latest_version
from prometheus_client.parser import text_string_to_metric_families

from dpserve.operator import builders as b
from dpserve.operator import spec as s
from dpserve.operator.status import compute_status
from dpserve.router.app import RouterSettings, create_app
from dpserve.router.pool import PoolSettings
from tests.workers import free_port

ROOT = Path(__file__).resolve().parents[2]
HERE = ROOT / "examples" / "autoscaling"
CRD = yaml.safe_load((ROOT / "charts/dpserve/crds/diffusionservices.dpserve.dev.yaml").read_text())
STUB = ROOT / "bench" / "stub_driver.py"
NAMESPACE = "default"  # the examples' namespace (the KEDA query names it)

# Field names of KEDA's keda.sh/v1alpha1 ScaledObject (config/crd/bases in kedacore/keda)
# and of its Prometheus scaler's trigger metadata (pkg/scalers/prometheus_scaler.go).
KEDA_SPEC = {
    "advanced", "cooldownPeriod", "fallback", "idleReplicaCount", "initialCooldownPeriod",
    "maxReplicaCount", "minReplicaCount", "pollingInterval", "scaleTargetRef", "triggers",
}  # fmt: skip
# Their integer fields, each with its minimum.
KEDA_INT32 = {
    "cooldownPeriod": 0, "idleReplicaCount": 0, "initialCooldownPeriod": 0,
    "maxReplicaCount": 1, "minReplicaCount": 0, "pollingInterval": 1,
}  # fmt: skip
KEDA_TARGET = {"apiVersion", "envSourceContainerName", "kind", "name"}
KEDA_TRIGGER = {"authenticationRef", "metadata", "metricType", "name", "type", "useCachedMetrics"}
KEDA_ADVANCED = {
    "horizontalPodAutoscalerConfig",
    "restoreToOriginalReplicaCount",
    "scalingModifiers",
}
KEDA_HPA_CONFIG = {"behavior", "name"}
KEDA_FALLBACK = {"behavior", "failureThreshold", "replicas"}
PROMETHEUS_REQUIRED = {"serverAddress", "query", "threshold"}
PROMETHEUS_OPTIONAL = {
    "queryParameters", "activationThreshold", "namespace", "customHeaders",
    "ignoreNullValues", "unsafeSsl", "awsRegion", "timeout", "identityOwner",
}  # fmt: skip


def load(name: str) -> Any:
    return yaml.safe_load((HERE / name).read_text())


def scrape_job() -> dict[str, Any]:
    (job,) = load("prometheus-scrape-config.yaml")["scrape_configs"]
    return dict(job)


def adapter_rule() -> dict[str, Any]:
    (rule,) = load("prometheus-adapter-values.yaml")["rules"]["external"]
    return dict(rule)


def gpu_service() -> dict[str, Any]:
    return dict(yaml.safe_load((ROOT / "examples/diffusionservice-gpu.yaml").read_text()))


def kube_version() -> str:
    return ".".join(latest_version().split(".")[:2])


# ------------------------------------------------------------------ PromQL, as far as used


def _selectors(query: str) -> list[str]:
    return re.findall(r"\{([^}]*)\}", query)


def query_labels(query: str) -> set[str]:
    """Label names a query matches on (``{a="x"}``) or aggregates by (``by (a)``)."""
    names = {m for sel in _selectors(query) for m in re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", sel)}
    for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", query):
        names |= {n.strip() for n in group.split(",") if n.strip()}
    return names


def query_metrics(query: str) -> set[str]:
    """Metric names in a query: identifiers outside selectors and groupings that are not
    function or aggregation calls."""
    bare = re.sub(r"\{[^}]*\}|\b(?:by|without)\s*\([^)]*\)", " ", query)
    return set(re.findall(r"\b([a-zA-Z_:][\w:]*)\b(?!\s*\()", bare))


def adapter_query(rule: dict[str, Any], matchers: str) -> str:
    """The PromQL prometheus-adapter runs for an External metric: the rule's template with
    the series and the label matchers (the HPA's namespace and metric selector) filled in."""
    (series,) = query_metrics(rule["seriesQuery"])
    return (
        str(rule["metricsQuery"])
        .replace("<<.Series>>", series)
        .replace("<<.LabelMatchers>>", matchers)
    )


def outer_call(query: str) -> str | None:
    """The function or aggregation whose parentheses enclose the whole query, if any
    (one with a ``by``/``without`` clause does not count: it keeps several series)."""
    match = re.match(r"(\w+)\s*\(", query.strip())
    if match is None:
        return None
    depth = 0
    for i, char in enumerate(query.strip()):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0 and i >= match.end() - 1:
            return match.group(1) if i == len(query.strip()) - 1 else None
    return None


def test_the_promql_reader_reads_the_shapes_the_examples_use() -> None:
    q = 'sum(max by (replica) (m_a{namespace="x",svc!=""})) / sum(m_b) + rate(m_c[1m])'
    assert query_metrics(q) == {"m_a", "m_b", "m_c"}
    assert query_labels(q) == {"replica", "namespace", "svc"}
    assert outer_call("sum(max by (r) (m))") == "sum"
    assert outer_call("sum(m) / sum(n)") is None and outer_call("sum by (r) (m)") is None


# ------------------------------------------------------------------ the router's /metrics


@pytest.fixture(scope="module")
def router_metrics() -> Iterator[dict[str, set[str]]]:
    """Metric name -> the label names its samples carry, from a real router's /metrics."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(STUB), "--port", str(port)])

    async def scrape() -> str:
        app = create_app(RouterSettings(workers=(f"tcp://127.0.0.1:{port}",)))
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as http:
                for _ in range(600):  # 30 s: a loaded machine starts slowly
                    if (await http.get("/ready")).status_code == 200:
                        break
                    await asyncio.sleep(0.05)
                else:
                    raise AssertionError("the stub driver never served")
                return (await http.get("/metrics")).text

    try:
        text = asyncio.run(scrape())
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    found: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, set()).update(sample.labels)
    yield found


def example_queries() -> dict[str, str]:
    keda = load("keda-scaledobject.yaml")
    rule = adapter_rule()
    queries = {"adapter seriesQuery": rule["seriesQuery"]}
    queries["adapter metricsQuery"] = adapter_query(rule, 'namespace="x",dpserve_service="y"')
    for i, trigger in enumerate(keda["spec"]["triggers"]):
        queries[f"keda trigger {i}"] = trigger["metadata"]["query"]
    return queries


def target_labels() -> set[str]:
    """Labels every scraped series gets from the scrape job (and Prometheus itself)."""
    return {c["target_label"] for c in scrape_job()["relabel_configs"] if "target_label" in c} | {
        "job",
        "instance",
    }


@pytest.mark.parametrize("source", list(example_queries()))
def test_every_metric_and_label_the_examples_query_is_scraped_from_the_router(
    source: str, router_metrics: dict[str, set[str]]
) -> None:
    query = example_queries()[source]
    metrics = query_metrics(query)
    assert metrics, f"{source}: no metric found in {query!r}"
    for name in metrics:
        assert name in router_metrics, f"{source}: the router exports no {name}"
        missing = query_labels(query) - router_metrics[name] - target_labels()
        assert not missing, f"{source}: {name} carries no label {sorted(missing)}"


def test_the_per_replica_signals_are_labelled_by_replica(
    router_metrics: dict[str, set[str]],
) -> None:
    """What docs/autoscaling.md lists: per replica, keyed as dpserve_replica_in_flight is."""
    for name in (
        "dpserve_replica_queue_depth",
        "dpserve_replica_outstanding_work_seconds",
        "dpserve_replica_busy_fraction",
        "dpserve_replica_in_flight",
    ):
        assert router_metrics.get(name) == {"replica"}, name
    for name in ("dpserve_outstanding_work_seconds", "dpserve_queue_depth"):
        assert router_metrics.get(name) == set(), name


def test_every_metric_the_docs_name_is_scraped_from_the_router(
    router_metrics: dict[str, set[str]],
) -> None:
    """docs/autoscaling.md names router metrics, the adapter's metric and a scrape label."""
    text = (ROOT / "docs" / "autoscaling.md").read_text()
    named = set(re.findall(r"\bdpserve_[a-z_]+\b", text))
    ours = {adapter_rule()["name"]["as"]} | target_labels()
    assert {"dpserve_replica_outstanding_work_seconds", "dpserve_service"} <= named
    assert not named - ours - set(router_metrics), sorted(named - ours - set(router_metrics))


def test_hpa_and_keda_scale_on_the_same_query_and_target() -> None:
    hpa, keda = load("hpa.yaml"), load("keda-scaledobject.yaml")
    (metric,) = hpa["spec"]["metrics"]
    (trigger,) = keda["spec"]["triggers"]
    selector = metric["external"]["metric"]["selector"]["matchLabels"]
    matchers = ",".join(f'{k}="{v}"' for k, v in {"namespace": NAMESPACE, **selector}.items())
    assert adapter_query(adapter_rule(), matchers) == trigger["metadata"]["query"]
    assert metric["external"]["metric"]["name"] == adapter_rule()["name"]["as"]
    assert metric["external"]["target"] == {"type": "AverageValue", "averageValue": "30"}
    assert trigger["metricType"] == "AverageValue"
    assert float(trigger["metadata"]["threshold"]) == float(
        metric["external"]["target"]["averageValue"]
    )
    assert (
        hpa["spec"]["behavior"]
        == keda["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    )
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (
        keda["spec"]["minReplicaCount"],
        keda["spec"]["maxReplicaCount"],
    )
    # Both select the service they scale, by the label the scrape job derives.
    assert selector == {"dpserve_service": hpa["spec"]["scaleTargetRef"]["name"]}
    assert "dpserve_service" in target_labels()


def test_the_adapter_rule_is_shaped_as_prometheus_adapter_reads_it() -> None:
    """Field names of prometheus-adapter's discovery rules (docs/config.md in
    kubernetes-sigs/prometheus-adapter) and of its Helm chart's values."""
    values = load("prometheus-adapter-values.yaml")
    assert set(values) == {"prometheus", "rules"} and set(values["prometheus"]) == {"url", "port"}
    assert values["rules"]["default"] is False and set(values["rules"]) == {"default", "external"}
    rule = adapter_rule()
    assert set(rule) <= {"seriesQuery", "seriesFilters", "resources", "name", "metricsQuery"}
    (series,) = query_metrics(rule["seriesQuery"])
    assert re.fullmatch(rule["name"]["matches"], series) and set(rule["name"]) == {"matches", "as"}
    # The namespace label is tied to the namespace resource, so the adapter adds the HPA's
    # namespace as a matcher (and a service in another namespace is never counted).
    assert rule["resources"] == {"overrides": {"namespace": {"resource": "namespace"}}}
    assert {"<<.Series>>", "<<.LabelMatchers>>"} <= set(
        re.findall(r"<<[^>]*>>", rule["metricsQuery"])
    )
    assert "<<.GroupBy>>" not in rule["metricsQuery"]  # empty for External metrics


# ------------------------------------------------------------------ the scrape job


def _sanitize(name: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def discovered(pod: dict[str, Any], ip: str) -> list[dict[str, str]]:
    """The targets Prometheus' ``role: pod`` discovery makes of a pod: one per container
    port, with the pod's metadata as ``__meta_kubernetes_*`` labels."""
    meta = pod["metadata"]
    common = {
        "__meta_kubernetes_namespace": meta["namespace"],
        "__meta_kubernetes_pod_name": meta["name"],
        "__meta_kubernetes_pod_ip": ip,
    }
    for kind in ("label", "annotation"):
        for key, value in meta.get(f"{kind}s", {}).items():
            common[f"__meta_kubernetes_pod_{kind}_{_sanitize(key)}"] = value
            common[f"__meta_kubernetes_pod_{kind}present_{_sanitize(key)}"] = "true"
    return [
        {
            **common,
            "__address__": f"{ip}:{port['containerPort']}",
            "__meta_kubernetes_pod_container_name": container["name"],
            "__meta_kubernetes_pod_container_port_name": port.get("name", ""),
            "__meta_kubernetes_pod_container_port_number": str(port["containerPort"]),
        }
        for container in pod["spec"]["containers"]
        for port in container.get("ports", [])
    ]


def relabel(target: dict[str, str], configs: list[dict[str, Any]]) -> dict[str, str] | None:
    """Prometheus relabelling (``keep`` and ``replace``): None when the target is dropped."""
    labels = dict(target)
    for config in configs:
        action = config.get("action", "replace")
        value = config.get("separator", ";").join(
            labels.get(name, "") for name in config.get("source_labels", [])
        )
        match = re.fullmatch(config.get("regex", "(.*)"), value)
        if action == "keep":
            if match is None:
                return None
        elif action == "replace":
            if match is not None:
                replacement = re.sub(r"\$(\d+)", r"\\\1", config.get("replacement", "$1"))
                labels[config["target_label"]] = match.expand(replacement)
        else:
            raise AssertionError(f"this model of relabelling has no action {action!r}")
    return labels


def test_the_scrape_job_finds_router_pods_and_only_them() -> None:
    obj = gpu_service()
    svc = b.Svc(
        obj["metadata"]["name"],
        "team-a",
        "uid-1",
        1,
        s.DiffusionServiceSpec.model_validate(obj["spec"]),
    )
    images = b.Images(worker="w", router="r")
    deployment = b.build_router_deployment(svc, images)
    template = deployment["spec"]["template"]
    router_pod = {
        "metadata": {
            **template["metadata"],
            "name": "qwen-image-router-7d9f-x2x",
            "namespace": "team-a",
        },
        "spec": template["spec"],
    }
    replica_pod = b.build_replica_pod(svc, 0, images)
    job = scrape_job()
    assert job.get("metrics_path", "/metrics") == "/metrics"  # the router's route
    assert job.get("scheme", "http") == "http"  # the router serves plain HTTP on `http`
    assert [sd["role"] for sd in job["kubernetes_sd_configs"]] == ["pod"]
    (kept,) = [
        t
        for t in (relabel(x, job["relabel_configs"]) for x in discovered(router_pod, "10.0.0.7"))
        if t
    ]
    assert kept["__address__"] == f"10.0.0.7:{b.ROUTER_PORT}"
    assert (kept["namespace"], kept["dpserve_service"], kept["pod"]) == (
        "team-a", "qwen-image", "qwen-image-router-7d9f-x2x",
    )  # fmt: skip
    replica_targets = discovered(replica_pod, "10.0.0.8")
    assert replica_targets  # it has a port, so discovery sees it: the job must drop it
    assert all(relabel(t, job["relabel_configs"]) is None for t in replica_targets)


# ------------------------------------------------------------------ the HPA


def test_the_hpa_is_valid_kubernetes_and_targets_the_scale_subresource() -> None:
    hpa = load("hpa.yaml")
    version = kube_version()
    assert kubernetes_validate.validate(hpa, version, strict=True) == version
    ref = hpa["spec"]["scaleTargetRef"]
    assert ref == {"apiVersion": f"{s.GROUP}/{s.VERSION}", "kind": s.KIND, "name": "qwen-image"}
    assert (CRD["spec"]["group"], CRD["spec"]["names"]["kind"]) == (s.GROUP, s.KIND)
    (served,) = [v for v in CRD["spec"]["versions"] if v["name"] == s.VERSION and v["served"]]
    scale = served["subresources"]["scale"]
    assert scale["specReplicasPath"] == ".spec.replicas"
    assert scale["statusReplicasPath"] == ".status.replicas"
    replicas = served["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["replicas"]
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"] <= replicas["maximum"]
    # The service it scales is the GPU example, whose rolls take one replica down at a time:
    # the minimum keeps one serving meanwhile, as hpa.yaml says.
    obj = gpu_service()
    spec = s.DiffusionServiceSpec.model_validate(obj["spec"])
    assert obj["metadata"]["name"] == ref["name"]
    assert hpa["spec"]["minReplicas"] - spec.updateStrategy.maxUnavailable >= 1


# ------------------------------------------------------------------ the KEDA ScaledObject


def test_the_scaled_object_has_the_fields_keda_requires() -> None:
    obj = load("keda-scaledobject.yaml")
    assert (obj["apiVersion"], obj["kind"]) == ("keda.sh/v1alpha1", "ScaledObject")
    assert set(obj) == {"apiVersion", "kind", "metadata", "spec"} and obj["metadata"]["name"]
    spec = obj["spec"]
    assert set(spec) <= KEDA_SPEC and {"scaleTargetRef", "triggers"} <= set(spec)
    for field, minimum in KEDA_INT32.items():
        if field in spec:
            assert type(spec[field]) is int and minimum <= spec[field] < 2**31, field
    assert spec.get("minReplicaCount", 0) <= spec.get("maxReplicaCount", 100)
    # KEDA scales any resource with a scale subresource, named by group/version and kind.
    ref = spec["scaleTargetRef"]
    assert set(ref) <= KEDA_TARGET
    assert ref == {"apiVersion": f"{s.GROUP}/{s.VERSION}", "kind": s.KIND, "name": "qwen-image"}
    assert set(spec["advanced"]) <= KEDA_ADVANCED
    assert set(spec["advanced"]["horizontalPodAutoscalerConfig"]) <= KEDA_HPA_CONFIG
    # KEDA passes the behaviour to the HPA it makes: it must be a valid HPA behaviour.
    hpa = load("hpa.yaml")
    hpa["spec"]["behavior"] = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    kubernetes_validate.validate(hpa, kube_version(), strict=True)
    # Fallback: both counts, non-negative; KEDA allows it only for AverageValue targets.
    fallback = spec["fallback"]
    assert set(fallback) <= KEDA_FALLBACK and {"failureThreshold", "replicas"} <= set(fallback)
    assert all(
        type(fallback[k]) is int and fallback[k] >= 0 for k in ("failureThreshold", "replicas")
    )
    assert spec["minReplicaCount"] <= fallback["replicas"] <= spec["maxReplicaCount"]
    (trigger,) = spec["triggers"]
    assert set(trigger) <= KEDA_TRIGGER and trigger["type"] == "prometheus"
    assert trigger.get("metricType", "AverageValue") == "AverageValue"
    metadata = trigger["metadata"]
    assert all(isinstance(v, str) for v in metadata.values()), "trigger metadata are strings"
    assert PROMETHEUS_REQUIRED <= set(metadata) <= PROMETHEUS_REQUIRED | PROMETHEUS_OPTIONAL
    assert float(metadata["threshold"]) > 0
    assert metadata["ignoreNullValues"] in ("true", "false")
    assert re.fullmatch(r"https?://[^/\s]+(:\d+)?/?\S*", metadata["serverAddress"])
    assert f'namespace="{NAMESPACE}"' in metadata["query"]
    # KEDA refuses an answer of more than one series: the query is one sum with no `by`.
    assert outer_call(metadata["query"]) == "sum"


def test_the_scaled_object_never_scales_to_zero() -> None:
    """Left out on purpose (docs/autoscaling.md, Scale to zero): at 0 replicas the router
    is unready and nothing reaches it to be measured, as the two tests below show."""
    spec = load("keda-scaledobject.yaml")["spec"]
    assert spec["minReplicaCount"] >= 1 and "idleReplicaCount" not in spec
    assert "cooldownPeriod" not in spec  # KEDA uses it only for the step to zero


def test_a_service_at_zero_replicas_is_not_ready() -> None:
    """At 0 the router pods fail readiness, so its Deployment has none available."""
    spec = s.DiffusionServiceSpec.model_validate({"model": {"path": "/m"}, "replicas": 0})
    unavailable = {"spec": {"replicas": 1}, "status": {"availableReplicas": 0}}
    status = compute_status(b.Svc("x", "ns", "u", 1, spec), [], {}, router=unavailable)
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "RouterNotAvailable")
    assert (status["replicas"], status["ready"]) == (0, "0/0")


def test_a_router_without_replicas_is_unready_and_only_queues() -> None:
    """With replicas: 0 the router's readiness probe fails (so its Service sends it
    nothing), and a request that reaches it anyway waits in its queue, is counted in
    dpserve_queue_depth, and is answered 503 at the request timeout."""

    async def scenario() -> tuple[httpx.Response, float, httpx.Response]:
        settings = RouterSettings(workers=(), pool=PoolSettings(request_timeout_s=1.0))
        app = create_app(settings)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as http:
                ready = await http.get("/ready")
                body = {"prompt": "x", "size": "64x64", "num_inference_steps": 1}
                request = asyncio.create_task(http.post("/v1/images/generations", json=body))
                await asyncio.sleep(0.3)
                text = (await http.get("/metrics")).text
                waiting = next(
                    sample.value
                    for family in text_string_to_metric_families(text)
                    for sample in family.samples
                    if sample.name == "dpserve_queue_depth"
                )
                return ready, waiting, await request

    ready, waiting, answer = asyncio.run(scenario())
    assert ready.status_code == 503 and ready.json()["serving"] == 0
    assert waiting == 1
    assert answer.status_code == 503 and answer.headers["retry-after"]
