"""The CRD: generated from the code, structural, and its CEL rules say what they mean."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import celpy
import pytest
import yaml

from dpserve.operator.crd import build_crd, crd_yaml
from dpserve.operator.spec import (
    MIN_DOMAINS_MESSAGE,
    ROLE_MESSAGE,
    ROLE_NOT_IMPLEMENTED,
    DiffusionServiceSpec,
    problems,
)

CHECKED_IN = Path(__file__).parents[2] / "charts/dpserve/crds/diffusionservices.dpserve.dev.yaml"


def test_checked_in_crd_is_the_generated_one() -> None:
    assert CHECKED_IN.read_text() == crd_yaml(), (
        "charts/dpserve/crds is stale: run `dpserve crd > "
        "charts/dpserve/crds/diffusionservices.dpserve.dev.yaml`"
    )


def _walk(node: Any, path: str = "") -> list[tuple[str, dict[str, Any]]]:
    out = []
    if isinstance(node, dict):
        out.append((path, node))
        for key, value in node.get("properties", {}).items():
            out += _walk(value, f"{path}.{key}")
        for key in ("items", "additionalProperties"):
            if isinstance(node.get(key), dict):
                out += _walk(node[key], f"{path}[{key}]")
    return out


def test_schema_is_structural() -> None:
    version = build_crd()["spec"]["versions"][0]
    root = version["schema"]["openAPIV3Schema"]
    for path, node in _walk(root):
        assert "type" in node or node.get("x-kubernetes-preserve-unknown-fields"), path
        for banned in ("$ref", "anyOf", "oneOf", "allOf", "title", "$defs"):
            assert banned not in node, f"{path} has {banned}"
        assert node.get("additionalProperties") is not False, path
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    assert "status" in version["subresources"]
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert list(columns) == ["Ready", "Replicas", "Parallel", "Model", "Age"]
    assert columns["Model"] == ".status.model.progress"
    # READY is the Ready condition (replicas and router), REPLICAS ready/desired.
    assert columns["Ready"] == '.status.conditions[?(@.type=="Ready")].status'
    assert columns["Replicas"] == ".status.ready"
    names = build_crd()["spec"]["names"]
    assert names["shortNames"] == ["dsvc"] and names["kind"] == "DiffusionService"


def test_defaults_and_bounds() -> None:
    spec = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    props = spec["properties"]
    assert spec["required"] == ["model"]
    assert props["replicas"]["default"] == 1 and props["replicas"]["minimum"] == 0
    assert props["parallelism"]["default"] == {"tp": 1, "sp": 1, "cfg": 1}
    assert props["parallelism"]["properties"]["cfg"]["maximum"] == 2
    assert props["role"]["enum"] == ["monolithic", "encoder", "denoiser", "decoder"]
    assert props["gpuResource"]["default"] == "nvidia.com/gpu"
    strategy = props["updateStrategy"]["properties"]
    assert strategy["maxUnavailable"]["default"] == 1 and strategy["maxSurge"]["default"] == 0
    bound = props["router"]["properties"]["videoMaxEstimateSeconds"]  # docs/video.md
    assert (bound["default"], bound["minimum"], bound["type"]) == (1800, 1, "integer")


def _rules() -> dict[str, tuple[dict[str, Any], list[dict[str, str]]]]:
    """Every CEL rule with the schema node it sits on, by its message."""
    root = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    out = {}
    for _, node in _walk(root):
        for rule in node.get("x-kubernetes-validations", []):
            out[rule["message"]] = (node, [rule])
    return out


def _holds(message: str, obj: dict[str, Any]) -> bool:
    _, (rule,) = _rules()[message]
    env = celpy.Environment()
    program = env.program(env.compile(rule["rule"]))
    return bool(program.evaluate({"self": celpy.json_to_cel(obj)}))


def test_cel_role_rule() -> None:
    assert _holds(ROLE_MESSAGE, {"role": "monolithic", "replicas": 4})
    assert _holds(ROLE_MESSAGE, {"role": "denoiser", "replicas": 1})
    assert not _holds(ROLE_MESSAGE, {"role": "denoiser", "replicas": 2})


def test_the_roles_nothing_implements_are_refused() -> None:
    # No builder reads role: a disaggregated one would run as monolithic, so the
    # apiserver refuses it, and the operator too where an older CRD admitted it.
    assert _holds(ROLE_NOT_IMPLEMENTED, {"role": "monolithic", "replicas": 4})
    for role in ("encoder", "denoiser", "decoder"):
        assert not _holds(ROLE_NOT_IMPLEMENTED, {"role": role, "replicas": 1})
        spec = DiffusionServiceSpec.model_validate({"model": {"path": "/m"}, "role": role})
        assert problems(spec) == [ROLE_NOT_IMPLEMENTED]
    assert "not implemented" in ROLE_NOT_IMPLEMENTED


@pytest.mark.parametrize(
    ("parallelism", "ok"),
    [
        ({"sp": 4}, True),
        ({"sp": 4, "ulysses": 2, "ring": 2}, True),
        ({"sp": 4, "ulysses": 4}, True),
        ({"sp": 4, "ulysses": 2}, False),
        ({"sp": 2, "ulysses": 2, "ring": 2}, False),
        ({"sp": 1, "ring": 2}, False),
    ],
)
def test_cel_sequence_parallel_rule(parallelism: dict[str, int], ok: bool) -> None:
    message = "parallelism.ulysses * parallelism.ring must equal parallelism.sp"
    assert _holds(message, {"tp": 1, "cfg": 1, **parallelism}) is ok


def test_cel_volume_and_strategy_rules() -> None:
    volume = "model.volume needs exactly one of persistentVolumeClaim or hostPath"
    assert _holds(volume, {"path": "/m"})
    assert _holds(volume, {"path": "/m", "volume": {"hostPath": {"path": "/x"}}})
    both = {"persistentVolumeClaim": {"claimName": "a"}, "hostPath": {"path": "/x"}}
    assert not _holds(volume, {"path": "/m", "volume": both})
    assert not _holds(volume, {"path": "/m", "volume": {}})
    strategy = "updateStrategy needs maxUnavailable > 0 or maxSurge > 0 to make progress"
    assert _holds(strategy, {"maxUnavailable": 0, "maxSurge": 1})
    assert not _holds(strategy, {"maxUnavailable": 0, "maxSurge": 0})


def test_crd_file_parses_as_yaml() -> None:
    assert yaml.safe_load(CHECKED_IN.read_text())["metadata"]["name"] == (
        "diffusionservices.dpserve.dev"
    )


def test_host_path_models_are_refused_unless_the_operator_allows_them() -> None:
    from dpserve.operator.spec import HOST_PATH_REFUSED, DiffusionServiceSpec, problems

    on_host = DiffusionServiceSpec.model_validate(
        {"model": {"path": "/models/m", "volume": {"hostPath": {"path": "/srv/m"}}}}
    )
    assert problems(on_host) == [HOST_PATH_REFUSED]
    assert (
        "persistentVolumeClaim" in HOST_PATH_REFUSED and "allowHostPathModels" in HOST_PATH_REFUSED
    )
    assert problems(on_host, allow_host_path=True) == []
    on_pvc = DiffusionServiceSpec.model_validate(
        {"model": {"path": "/models/m", "volume": {"persistentVolumeClaim": {"claimName": "m"}}}}
    )
    assert problems(on_pvc) == []


def test_router_auth_names_a_secret() -> None:
    from pydantic import ValidationError

    from dpserve.operator.spec import RouterSpec

    assert RouterSpec.model_validate({"auth": {"secretName": "keys"}}).auth is not None
    assert RouterSpec().auth is None
    with pytest.raises(ValidationError):
        RouterSpec.model_validate({"auth": {"secretName": ""}})


def test_the_operator_reads_the_charts_host_path_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    from dpserve.operator import handlers
    from dpserve.operator.spec import HOST_PATH_REFUSED, DiffusionServiceSpec

    on_host = DiffusionServiceSpec.model_validate(
        {"model": {"path": "/models/m", "volume": {"hostPath": {"path": "/srv/m"}}}}
    )
    for value, allowed in ((None, False), ("false", False), ("true", True), ("True", True)):
        if value is None:
            monkeypatch.delenv("DPSERVE_ALLOW_HOSTPATH_MODELS", raising=False)
        else:
            monkeypatch.setenv("DPSERVE_ALLOW_HOSTPATH_MODELS", value)
        assert handlers.allow_host_path_from_env() is allowed
    with pytest.raises(handlers.InvalidSpec, match="allowHostPathModels"):
        handlers._check_beyond_crd(on_host, allow_host_path=False)
    handlers._check_beyond_crd(on_host, allow_host_path=True)
    assert "hostPath" in HOST_PATH_REFUSED


def test_cel_model_source_rules() -> None:
    from dpserve.operator.spec import (
        FETCH_ONLY,
        SOURCE_NEEDS_CACHE,
        SOURCE_NOT_VOLUME,
        SOURCE_XOR_PATH,
    )

    fetched = {"source": "s3://b/m/", "cache": {"claimName": "c"}}
    assert _holds(SOURCE_XOR_PATH, {"path": "/m"}) and _holds(SOURCE_XOR_PATH, fetched)
    assert not _holds(SOURCE_XOR_PATH, {**fetched, "path": "/m"})
    assert not _holds(SOURCE_XOR_PATH, {"mountPath": "/models"})
    assert _holds(SOURCE_NEEDS_CACHE, fetched)
    assert not _holds(SOURCE_NEEDS_CACHE, {"source": "s3://b/m/"})
    claim = {"persistentVolumeClaim": {"claimName": "a"}}
    assert not _holds(SOURCE_NOT_VOLUME, {**fetched, "volume": claim})
    assert _holds(SOURCE_NOT_VOLUME, {"path": "/m", "volume": claim})
    assert not _holds(FETCH_ONLY, {"path": "/m", "cache": {"claimName": "c"}})
    assert not _holds(FETCH_ONLY, {"path": "/m", "credentials": {"secretName": "s"}})
    assert _holds(FETCH_ONLY, fetched)


def test_cel_a_cache_is_a_claim_or_a_node_folder() -> None:
    from dpserve.operator.spec import CACHE_ONE_OF

    node = {"nodeLocal": {"path": "/var/lib/dpserve/models"}}
    assert _holds(CACHE_ONE_OF, {"claimName": "c"}) and _holds(CACHE_ONE_OF, node)
    assert not _holds(CACHE_ONE_OF, {**node, "claimName": "c"})
    assert not _holds(CACHE_ONE_OF, {"keep": 1})
    fetched = {"source": "s3://b/m/", "cache": node}
    assert DiffusionServiceSpec.model_validate({"model": fetched}).model.cache is not None


def test_placement_fields_are_checked_at_apply_time() -> None:
    props = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]
    spec = props["spec"]["properties"]
    spread = spec["topologySpreadConstraints"]
    assert spread["type"] == "array" and spread["maxItems"] == 8
    item = spread["items"]
    assert item["required"] == ["topologyKey"]
    fields = item["properties"]
    assert "labelSelector" not in fields  # the operator's: this service's replicas
    assert fields["maxSkew"]["minimum"] == 1 and fields["maxSkew"]["default"] == 1
    assert fields["whenUnsatisfiable"]["enum"] == ["ScheduleAnyway", "DoNotSchedule"]
    assert fields["whenUnsatisfiable"]["default"] == "ScheduleAnyway"
    assert spec["onePerNode"]["type"] == "boolean" and spec["onePerNode"]["default"] is False
    priority = spec["priorityClassName"]
    assert priority["maxLength"] == 253 and priority["pattern"].startswith("^[a-z0-9]")
    assert _holds(
        MIN_DOMAINS_MESSAGE,
        {"topologyKey": "k", "whenUnsatisfiable": "DoNotSchedule", "minDomains": 2},
    )
    assert _holds(MIN_DOMAINS_MESSAGE, {"topologyKey": "k", "whenUnsatisfiable": "ScheduleAnyway"})
    assert not _holds(
        MIN_DOMAINS_MESSAGE,
        {"topologyKey": "k", "whenUnsatisfiable": "ScheduleAnyway", "minDomains": 2},
    )
    # Mirrored in the operator, for a cluster whose older CRD lacks the rule.
    loose = DiffusionServiceSpec.model_validate(
        {
            "model": {"path": "/m"},
            "topologySpreadConstraints": [{"topologyKey": "k", "minDomains": 2}],
        }
    )
    assert problems(loose) == [MIN_DOMAINS_MESSAGE]
