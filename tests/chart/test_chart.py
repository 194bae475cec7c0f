"""The Helm chart, the examples and the Dockerfile, checked offline and fast.

helm comes from a PyPI package (``tests/chart/tools.py``); manifests are validated with
kubernetes-validate's copy of the Kubernetes OpenAPI schemas; the examples with the
CRD's own schema and with the pydantic models the operator parses them with.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import latest_version
from packaging.version import Version

from dpserve.operator import spec as s
from dpserve.operator.kube import required_rules
from tests.chart import tools

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "dpserve"
CRD_FILE = CHART / "crds" / "diffusionservices.dpserve.dev.yaml"
EXAMPLES = ROOT / "examples"
DOCKERFILE = ROOT / "Dockerfile"
RELEASE, NAMESPACE = "dpserve", "dpserve-system"
APP_VERSION = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
# Resources without a namespace: their permissions can only be granted cluster-wide.
CLUSTER_SCOPED = {("apiextensions.k8s.io", "customresourcedefinitions"), ("", "namespaces")}
STANDARD_LABELS = (
    "app.kubernetes.io/name",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/version",
    "app.kubernetes.io/managed-by",
    "helm.sh/chart",
)
# Namespaced mode and images from a registry: the override the tests render beside the defaults.
OVERRIDE: dict[str, Any] = {
    "watchNamespaces": ["team-a", "team-b"],
    "livenessPort": 9090,
    "image": {
        "tag": "1.2.3",
        "pullPolicy": "Always",
        "operator": {"repository": "registry.example.com/dpserve/operator"},
        "router": {"repository": "registry.example.com/dpserve/router", "tag": "1.2.4"},
        "worker": {"repository": "registry.example.com/dpserve/worker", "tag": "1.2.3-cuda"},
    },
    "imagePullSecrets": [{"name": "regcred"}],
    "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"memory": "256Mi"}},
}

Grant = tuple[str, str, str]  # (apiGroup, resource, verb)
Helm = Callable[..., subprocess.CompletedProcess[str]]


# ------------------------------------------------------------------ helm


@pytest.fixture(scope="session")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Helm:
    """Run the packaged helm with private, empty cache/config/data folders (offline)."""
    try:
        binary = tools.helm()
    except tools.ToolUnavailable as exc:
        pytest.fail(f"helm is unavailable: {exc}")
    env = tools.helm_env(tmp_path_factory.mktemp("helm-home"))
    env["KUBECONFIG"] = str(tmp_path_factory.mktemp("kube") / "absent")  # never a cluster

    def run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [str(binary), *args], capture_output=True, text=True, env=env, timeout=60, cwd=ROOT
        )
        if check and done.returncode != 0:
            pytest.fail(f"helm {' '.join(args)} failed ({done.returncode}):\n{done.stderr}")
        return done

    return run


@pytest.fixture(scope="session")
def override_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("values") / "override.yaml"
    path.write_text(yaml.safe_dump(OVERRIDE))
    return path


def render(helm: Helm, *args: str) -> list[dict[str, Any]]:
    out = helm("template", RELEASE, str(CHART), "--namespace", NAMESPACE, *args).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


@pytest.fixture(scope="session")
def default_docs(helm: Helm) -> list[dict[str, Any]]:
    return render(helm)


@pytest.fixture(scope="session")
def override_docs(helm: Helm, override_file: Path) -> list[dict[str, Any]]:
    return render(helm, "-f", str(override_file))


def only(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, got {[d['metadata']['name'] for d in found]}"
    return found[0]


def operator_container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (container,) = only(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    return container


def test_chart_metadata() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2"
    assert (chart["name"], chart["version"], chart["appVersion"]) == ("dpserve", "0.1.0", "0.1.0")


def test_helm_lint_strict(helm: Helm, override_file: Path) -> None:
    helm("lint", "--strict", str(CHART))
    helm("lint", "--strict", str(CHART), "-f", str(override_file))


def test_renders_the_expected_objects(
    default_docs: list[dict[str, Any]], override_docs: list[dict[str, Any]]
) -> None:
    kinds = sorted(d["kind"] for d in default_docs)
    assert kinds == ["ClusterRole", "ClusterRoleBinding", "Deployment", "ServiceAccount"]
    kinds = sorted(d["kind"] for d in override_docs)
    # Namespaced mode: a Role and a RoleBinding per watched namespace, nothing cluster-wide.
    assert kinds == sorted(["Deployment", "ServiceAccount", *["Role", "RoleBinding"] * 2])


def test_the_crd_is_installed_from_crds(helm: Helm) -> None:
    docs = render(helm, "--include-crds")
    crd = only(docs, "CustomResourceDefinition")
    assert crd == yaml.safe_load(CRD_FILE.read_text())
    assert crd["metadata"]["name"] == f"{s.PLURAL}.{s.GROUP}"


# ------------------------------------------------------------------ Kubernetes schemas


def kube_version() -> str:
    """The newest Kubernetes whose schemas kubernetes-validate ships (1.37 with 1.37.0)."""
    newest = latest_version()
    assert Version(newest) >= Version("1.35"), f"kubernetes-validate ships only {newest}"
    return ".".join(newest.split(".")[:2])


@pytest.mark.parametrize("mode", ["default", "override"])
def test_manifests_validate_against_kubernetes(mode: str, helm: Helm, override_file: Path) -> None:
    args = ["--include-crds"] + (["-f", str(override_file)] if mode == "override" else [])
    docs = render(helm, *args)
    version = kube_version()
    for doc in docs:
        name = f"{doc['kind']}/{doc['metadata']['name']}"
        try:
            # strict: unknown fields are errors, as with `kubectl apply --validate=strict`.
            validated = kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{name} is invalid for Kubernetes {version}: {exc.message} at {exc.path}")
        assert validated == version, name


def test_every_object_carries_the_standard_labels(
    default_docs: list[dict[str, Any]], override_docs: list[dict[str, Any]]
) -> None:
    for doc in default_docs + override_docs:
        labels = doc["metadata"].get("labels", {})
        missing = [key for key in STANDARD_LABELS if key not in labels]
        assert not missing, f"{doc['kind']}/{doc['metadata']['name']} lacks {missing}"
        assert labels["app.kubernetes.io/name"] == "dpserve"
        assert labels["app.kubernetes.io/instance"] == RELEASE
        assert labels["app.kubernetes.io/version"] == APP_VERSION
        assert labels["app.kubernetes.io/managed-by"] == "Helm"
        assert labels["helm.sh/chart"] == "dpserve-0.1.0"
    pod_labels = only(default_docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert all(key in pod_labels for key in STANDARD_LABELS)


# ------------------------------------------------------------------ values.schema.json

REJECTED = [
    pytest.param(["--set", "replicaCount=two"], "replicaCount", id="replicaCount-string"),
    pytest.param(["--set", "replicaCount=2"], "replicaCount", id="replicaCount-above-1"),
    pytest.param(["--set", "image.tag=5"], "tag", id="image.tag-number"),
    pytest.param(["--set", "image.worker.tag=true"], "tag", id="worker-tag-bool"),
    pytest.param(["--set", "image.pullPolicy=Sometimes"], "pullPolicy", id="pullPolicy-enum"),
    pytest.param(["--set", "livenessPort=http"], "livenessPort", id="livenessPort-string"),
    pytest.param(["--set", "watchNamespaces=team-a"], "watchNamespaces", id="namespaces-string"),
    pytest.param(["--set", "watchNamespaces={Team_A}"], "watchNamespaces", id="namespace-name"),
    pytest.param(["--set", "rbac.create=maybe"], "create", id="rbac.create-string"),
    pytest.param(["--set", "allowHostPathModels=yes"], "allowHostPathModels", id="hostpath-str"),
    pytest.param(["--set", "resources.requests=1"], "requests", id="resources-shape"),
    pytest.param(["--set", "unknownKey=1"], "unknownKey", id="unknown-top-level-key"),
    pytest.param(["--set", "image.operator.digest=x"], "digest", id="unknown-nested-key"),
]


@pytest.mark.parametrize(("args", "field"), REJECTED)
def test_values_schema_rejects(helm: Helm, args: list[str], field: str) -> None:
    done = helm("template", RELEASE, str(CHART), *args, check=False)
    assert done.returncode != 0, f"helm template {args} rendered: the schema let it through"
    assert "schema" in done.stderr, done.stderr
    assert field in done.stderr, done.stderr


def test_values_schema_accepts_the_defaults_and_the_override(override_file: Path) -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert schema["$schema"] == "http://json-schema.org/draft-07/schema#"
    jsonschema.Draft7Validator.check_schema(schema)
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    jsonschema.Draft7Validator(schema).validate(defaults)
    jsonschema.Draft7Validator(schema).validate(_merge(defaults, OVERRIDE))


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def test_every_value_is_documented() -> None:
    """Each key in values.yaml has a comment on the line(s) right above it or a parent's."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    undocumented = []
    for i, line in enumerate(lines):
        match = re.match(r"^(\s*)([A-Za-z][\w.-]*):", line)
        if not match:
            continue
        above = lines[i - 1].strip() if i else ""
        is_parent = i + 1 < len(lines) and lines[i + 1].startswith(match.group(1) + "  ")
        if not above.startswith("#") and not is_parent and not _under_documented(lines, i):
            undocumented.append(match.group(2))
    assert not undocumented, f"values without a comment: {undocumented}"


def test_docs_list_every_value() -> None:
    docs = (ROOT / "docs" / "kubernetes.md").read_text()
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    nested = ("image", "serviceAccount", "rbac")
    keys = [k for k in values if k not in nested]
    keys += ["image.tag", "image.pullPolicy"]
    keys += [f"image.{i}.{f}" for i in ("operator", "router", "worker") for f in values["image"][i]]
    keys += [f"{k}.{f}" for k in ("serviceAccount", "rbac") for f in values[k]]
    missing = [key for key in keys if f"`{key}`" not in docs]
    assert not missing, f"docs/kubernetes.md does not list {missing}"


def _under_documented(lines: list[str], i: int) -> bool:
    """Leaf keys of a documented default map (e.g. resources.requests.cpu) count as documented."""
    indent = len(lines[i]) - len(lines[i].lstrip())
    for j in range(i - 1, -1, -1):
        own = len(lines[j]) - len(lines[j].lstrip())
        if lines[j].strip() and not lines[j].lstrip().startswith("#") and own < indent:
            if own == 0:
                return j > 0 and lines[j - 1].startswith("#")
            indent = own
    return False


# ------------------------------------------------------------------ RBAC


def granted(docs: list[dict[str, Any]]) -> dict[str | None, set[Grant]]:
    """What the operator's ServiceAccount may do, by namespace (None: cluster-wide)."""
    sa = only(docs, "ServiceAccount")["metadata"]
    roles = {
        (d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]): d
        for d in docs
        if d["kind"] in ("ClusterRole", "Role")
    }
    out: dict[str | None, set[Grant]] = {}
    for binding in docs:
        if binding["kind"] not in ("ClusterRoleBinding", "RoleBinding"):
            continue
        subjects = {(x["kind"], x["name"], x.get("namespace")) for x in binding["subjects"]}
        if ("ServiceAccount", sa["name"], sa["namespace"]) not in subjects:
            continue
        scope = binding["metadata"]["namespace"] if binding["kind"] == "RoleBinding" else None
        ref = binding["roleRef"]
        role = roles[(ref["kind"], scope if ref["kind"] == "Role" else None, ref["name"])]
        out.setdefault(scope, set()).update(rule_grants(role))
    return out


def rule_grants(role: dict[str, Any]) -> set[Grant]:
    grants: set[Grant] = set()
    seen: set[tuple[str, str]] = set()
    for rule in role["rules"]:
        # One rule per (apiGroup, resource), no wildcards, no name restrictions.
        assert len(rule["apiGroups"]) == 1 and len(rule["resources"]) == 1, rule
        key = (rule["apiGroups"][0], rule["resources"][0])
        assert key not in seen, f"{key} appears in two rules of {role['metadata']['name']}"
        seen.add(key)
        assert "*" not in rule["verbs"] and "*" not in key, rule
        assert "resourceNames" not in rule and "nonResourceURLs" not in rule, rule
        assert len(set(rule["verbs"])) == len(rule["verbs"]), rule
        grants |= {(*key, verb) for verb in rule["verbs"]}
    return grants


def test_cluster_role_grants_exactly_what_the_operator_needs(
    default_docs: list[dict[str, Any]],
) -> None:
    role = only(default_docs, "ClusterRole")
    assert rule_grants(role) == required_rules()
    binding = only(default_docs, "ClusterRoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert granted(default_docs) == {None: required_rules()}


def test_namespaced_mode_grants_only_roles_in_the_watched_namespaces(
    override_docs: list[dict[str, Any]],
) -> None:
    grants = granted(override_docs)
    assert set(grants) == {"team-a", "team-b"}  # nothing cluster-wide
    assert not [d for d in override_docs if d["kind"].startswith("Cluster")]
    for namespace in ("team-a", "team-b"):
        assert not {g[:2] for g in grants[namespace]} & CLUSTER_SCOPED
        assert grants[namespace] == required_rules(cluster_wide=False)


def test_the_operator_can_read_no_secret() -> None:
    # The wire Secret is create-only (409: present): no verb reads a Secret.
    verbs = {
        verb for group, resource, verb in required_rules() if (group, resource) == ("", "secrets")
    }
    assert verbs == {"create"}


def test_host_path_models_are_off_unless_the_chart_allows_them(helm: Helm) -> None:
    assert env_of(operator_container(render(helm)))["DPSERVE_ALLOW_HOSTPATH_MODELS"] == "false"
    allowed = render(helm, "--set", "allowHostPathModels=true")
    assert env_of(operator_container(allowed))["DPSERVE_ALLOW_HOSTPATH_MODELS"] == "true"


def test_the_operator_holds_what_it_grants_the_router() -> None:
    # RBAC escalation prevention: a Role may only grant what its creator holds.
    from dpserve.operator.builders import ROUTER_RULES

    for rule in ROUTER_RULES:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    assert (group, resource, verb) in required_rules()


def test_server_side_apply_is_allowed_to_create() -> None:
    from dpserve.operator.kube import Kube

    applied = {(g, r) for g, r, verb in getattr(Kube.apply, "rbac", ()) if verb == "patch"}
    assert applied, "Kube.apply declares no permissions"
    missing = {(g, r, "create") for g, r in applied} - required_rules()
    assert not missing, f"server-side apply creates, but the operator may not: {sorted(missing)}"


# ------------------------------------------------------------------ the operator Deployment


def test_operator_deployment_defaults(default_docs: list[dict[str, Any]]) -> None:
    deployment = only(default_docs, "Deployment")
    spec = deployment["spec"]
    assert spec["replicas"] == 1
    assert spec["strategy"] == {"type": "Recreate"}
    pod = spec["template"]["spec"]
    assert pod["serviceAccountName"] == only(default_docs, "ServiceAccount")["metadata"]["name"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 10001
    container = operator_container(default_docs)
    assert container["command"] == ["dpserve"]
    assert container["args"] == ["operator", "--all-namespaces", "--liveness-port", "8080"]
    assert container["image"] == f"dpserve-operator:{APP_VERSION}"
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    assert security.get("runAsUser", 10001) == 10001 and security.get("runAsNonRoot", True)
    assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]
    assert {v["name"]: v for v in pod["volumes"]}["tmp"]["emptyDir"] is not None
    probe = container["livenessProbe"]["httpGet"]
    assert probe["path"] == "/healthz"
    port = {p["name"]: p["containerPort"] for p in container["ports"]}[probe["port"]]
    assert port == 8080
    assert set(container["resources"]) == {"requests", "limits"}
    assert (
        env_of(container).items()
        >= {
            "DPSERVE_WORKER_IMAGE": f"dpserve-worker:{APP_VERSION}",
            "DPSERVE_ROUTER_IMAGE": f"dpserve-router:{APP_VERSION}",
            "DPSERVE_IMAGE_PULL_POLICY": "IfNotPresent",
        }.items()
    )


def env_of(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


def test_operator_deployment_override(override_docs: list[dict[str, Any]]) -> None:
    container = operator_container(override_docs)
    assert container["args"] == [
        "operator",
        *("--namespace", "team-a", "--namespace", "team-b"),
        *("--liveness-port", "9090"),
    ]
    assert container["image"] == "registry.example.com/dpserve/operator:1.2.3"
    assert container["imagePullPolicy"] == "Always"
    assert (
        env_of(container).items()
        >= {
            "DPSERVE_WORKER_IMAGE": "registry.example.com/dpserve/worker:1.2.3-cuda",
            "DPSERVE_ROUTER_IMAGE": "registry.example.com/dpserve/router:1.2.4",
            "DPSERVE_IMAGE_PULL_POLICY": "Always",
        }.items()
    )
    assert container["livenessProbe"]["httpGet"]["port"] == "healthz"
    assert container["ports"] == [{"name": "healthz", "containerPort": 9090, "protocol": "TCP"}]
    # Helm merges maps: the default CPU limit stays unless set to null.
    assert container["resources"]["requests"] == OVERRIDE["resources"]["requests"]
    assert container["resources"]["limits"]["memory"] == "256Mi"
    pod = only(override_docs, "Deployment")["spec"]["template"]["spec"]
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]


def test_operator_can_be_paused(helm: Helm) -> None:
    deployment = only(render(helm, "--set", "replicaCount=0"), "Deployment")
    assert deployment["spec"]["replicas"] == 0


def test_operator_arguments_parse_with_the_cli(
    default_docs: list[dict[str, Any]], override_docs: list[dict[str, Any]]
) -> None:
    from dpserve.cli import build_parser

    for docs in (default_docs, override_docs):
        args = build_parser().parse_args(operator_container(docs)["args"])
        assert args.command == "operator"


# ------------------------------------------------------------------ NOTES.txt


def test_notes_explain_the_example_and_crd_upgrades(helm: Helm) -> None:
    out = helm("install", RELEASE, str(CHART), "-n", NAMESPACE, "--dry-run=client").stdout
    notes = out.split("NOTES:", 1)[1]
    assert "kubectl apply -f examples/diffusionservice-cpu.yaml" in notes
    assert "kubectl get dsvc" in notes
    assert "port-forward svc/tiny 8000:80" in notes
    assert "kubectl apply -f charts/dpserve/crds/" in notes
    assert "never upgrades" in notes


# ------------------------------------------------------------------ examples


def crd_json_schema() -> dict[str, Any]:
    """The CRD's openAPIV3Schema as a JSON Schema with the apiserver's strictness.

    A structural schema prunes unknown fields instead of rejecting them; here they are
    errors (``additionalProperties: false`` wherever fields are not preserved), so a
    misspelt field in an example fails instead of silently vanishing.
    """
    crd = yaml.safe_load(CRD_FILE.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == s.VERSION]
    return _strict(version["schema"]["openAPIV3Schema"])


def _strict(node: Any) -> Any:
    if isinstance(node, list):
        return [_strict(item) for item in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "properties":  # property names are data, not schema keywords
            out[key] = {name: _strict(sub) for name, sub in value.items()}
        elif not key.startswith("x-kubernetes-"):
            out[key] = _strict(value)
    preserve = node.get("x-kubernetes-preserve-unknown-fields")
    if node.get("type") == "object" and "properties" in node and not preserve:
        out.setdefault("additionalProperties", False)
    return out


def examples() -> Iterator[Any]:
    for path in sorted(EXAMPLES.glob("diffusionservice-*.yaml")):
        yield pytest.param(path, id=path.name)


def test_both_examples_exist() -> None:
    names = {p.name for p in EXAMPLES.glob("*.yaml")}
    assert {"diffusionservice-cpu.yaml", "diffusionservice-gpu.yaml"} <= names


@pytest.mark.parametrize("path", list(examples()))
def test_example_validates_against_the_crd(path: Path) -> None:
    (obj,) = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert obj["apiVersion"] == f"{s.GROUP}/{s.VERSION}" and obj["kind"] == s.KIND
    schema = crd_json_schema()
    jsonschema.Draft7Validator.check_schema(schema)
    errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(obj), key=str)
    assert not errors, "\n".join(f"{list(e.absolute_path)}: {e.message}" for e in errors)
    s.DiffusionServiceSpec.model_validate(obj["spec"])  # what the operator parses
    # The CRD's CEL rules, on the object as the apiserver sees it (defaults applied).
    version = yaml.safe_load(CRD_FILE.read_text())["spec"]["versions"][0]
    root = version["schema"]["openAPIV3Schema"]
    checked = cel_failures(root, with_defaults(root, copy.deepcopy(obj)))
    assert checked["failed"] == [], checked["failed"]
    assert checked["evaluated"] >= 3  # spec, model, parallelism, updateStrategy rules ran


def with_defaults(schema: dict[str, Any], value: Any) -> Any:
    """Apply the schema's defaults like the apiserver: absent fields get theirs, recursively."""
    if isinstance(value, dict) and "properties" in schema:
        for name, sub in schema["properties"].items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                value[name] = with_defaults(sub, value[name])
    elif isinstance(value, list) and "items" in schema:
        return [with_defaults(schema["items"], item) for item in value]
    return value


def cel_failures(schema: dict[str, Any], value: Any) -> dict[str, Any]:
    """Evaluate every x-kubernetes-validations rule that applies to ``value``."""
    out: dict[str, Any] = {"evaluated": 0, "failed": []}

    def walk(node: dict[str, Any], val: Any) -> None:
        for rule in node.get("x-kubernetes-validations", []):
            env = celpy.Environment()
            program = env.program(env.compile(rule["rule"]))
            out["evaluated"] += 1
            if not program.evaluate({"self": celpy.json_to_cel(val)}):
                out["failed"].append(rule["message"])
        if isinstance(val, dict):
            for name, sub in node.get("properties", {}).items():
                if name in val:
                    walk(sub, val[name])
        elif isinstance(val, list) and "items" in node:
            for item in val:
                walk(node["items"], item)

    walk(schema, value)
    return out


def test_the_strict_crd_schema_catches_mistakes() -> None:
    """The check above has teeth: a misspelt field and a wrong type are rejected."""
    (obj,) = yaml.safe_load_all((EXAMPLES / "diffusionservice-cpu.yaml").read_text())
    validator = jsonschema.Draft7Validator(crd_json_schema())
    for path, value in ((("spec", "replica"), 2), (("spec", "replicas"), "two")):
        bad = copy.deepcopy(obj)
        bad[path[0]][path[1]] = value
        assert list(validator.iter_errors(bad)), f"{path}={value!r} passed"


def test_cpu_example() -> None:
    obj = yaml.safe_load((EXAMPLES / "diffusionservice-cpu.yaml").read_text())
    spec = s.DiffusionServiceSpec.model_validate(obj["spec"])
    assert obj["metadata"]["name"] == "tiny"
    assert spec.model.path == "/models/tiny" and spec.model.volume is None
    assert (spec.device, spec.replicas, spec.threadsPerRank) == ("cpu", 2, 1)
    assert spec.parallelism == s.Parallelism()
    assert spec.maxSequenceLength == 77
    assert (spec.router.service.type, spec.router.service.port) == ("ClusterIP", 80)
    assert spec.image is None  # the chart's worker image, which carries /models/tiny


def test_gpu_example() -> None:
    obj = yaml.safe_load((EXAMPLES / "diffusionservice-gpu.yaml").read_text())
    spec = s.DiffusionServiceSpec.model_validate(obj["spec"])
    assert spec.replicas == 2 and spec.device == "cuda"
    assert spec.parallelism.cfg == 2 and spec.parallelism.gang_size == 2
    assert spec.model.source == "hf://Qwen/Qwen-Image" and spec.model.mountPath == "/models"
    assert spec.model.cache is not None and spec.model.cache.claimName == "model-cache"
    assert s.problems(spec) == []  # what the operator checks beyond the CRD, the URI too
    assert spec.gpuResource == "nvidia.com/gpu"
    assert any(t.get("key") == "nvidia.com/gpu" for t in spec.tolerations or [])
    assert spec.resources and "requests" in spec.resources
    assert spec.router.auth is not None
    secret = yaml.safe_load((EXAMPLES / "router-api-keys.yaml").read_text())
    assert (secret["kind"], secret["metadata"]["name"]) == ("Secret", spec.router.auth.secretName)
    # The keys the router pods read (builders.API_KEYS, ADMIN_KEYS), each a real key.
    assert set(secret["stringData"]) == {"api-keys", "admin-keys"}
    for lines in secret["stringData"].values():
        assert [x for x in lines.splitlines() if x.strip() and not x.startswith("#")]


# ------------------------------------------------------------------ Dockerfile


class Stage:
    def __init__(self, base: str, name: str) -> None:
        self.base, self.name = base, name
        self.instructions: list[tuple[str, str]] = []

    def all(self, op: str) -> list[str]:
        return [arg for ins, arg in self.instructions if ins == op]


def dockerfile() -> tuple[dict[str, str], dict[str, Stage]]:
    """Global ARG defaults and the stages of the Dockerfile (continuations joined)."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    global_args: dict[str, str] = {}
    stages: dict[str, Stage] = {}
    current: Stage | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        op, _, arg = line.partition(" ")
        op, arg = op.upper(), arg.strip()
        if op == "FROM":
            match = re.fullmatch(r"(?:--platform=\S+\s+)?(\S+)\s+AS\s+(\S+)", arg, re.IGNORECASE)
            assert match, f"every stage is named: FROM {arg}"
            current = Stage(match.group(1), match.group(2))
            stages[current.name] = current
        elif current is None:
            assert op == "ARG", f"only ARG may precede the first FROM, not {op}"
            name, _, default = arg.partition("=")
            global_args[name] = default
        else:
            current.instructions.append((op, arg))
    return global_args, stages


def mounts(run: str) -> list[dict[str, str]]:
    """The ``--mount=k=v,...`` options of one RUN, each as a dict."""
    found = re.findall(r"--mount=(\S+)", run)
    return [dict(kv.partition("=")[::2] for kv in spec.split(",")) for spec in found]


def sources(stage: Stage) -> list[str]:
    """The stages a stage reads from: COPY --from and RUN --mount=...,from=."""
    names = [m.group(1) for c in stage.all("COPY") if (m := re.search(r"--from=(\S+)", c))]
    names += [m["from"] for run in stage.all("RUN") for m in mounts(run) if "from" in m]
    return names


def closure(stages: dict[str, Stage], name: str) -> list[Stage]:
    """A stage and every stage it is built from or reads from."""
    seen: list[Stage] = []
    todo = [name]
    while todo:
        stage = stages[todo.pop()]
        if stage in seen:
            continue
        seen.append(stage)
        if stage.base in stages:
            todo.append(stage.base)
        todo.extend(s for s in sources(stage) if s in stages)
    return seen


def final_user(stages: dict[str, Stage], name: str) -> str | None:
    stage: Stage | None = stages[name]
    while stage is not None:
        users = stage.all("USER")
        if users:
            return users[-1]
        stage = stages.get(stage.base)
    return None


def context_paths() -> set[str]:
    """What the Dockerfile reads from the build context: COPY sources and RUN bind mounts."""
    _, stages = dockerfile()
    paths: set[str] = set()
    for stage in stages.values():
        for copy_arg in stage.all("COPY"):
            if "--from=" not in copy_arg:
                paths.update(word.rstrip("/") for word in copy_arg.split()[:-1])
        for run in stage.all("RUN"):
            paths.update(
                m["source"] for m in mounts(run) if m["type"] == "bind" and "from" not in m
            )
    return paths


def test_dockerfile_needs_no_frontend_image() -> None:
    # A `# syntax=` line makes BuildKit pull that frontend from a registry.
    assert not re.search(r"^#\s*syntax\s*=", DOCKERFILE.read_text(), re.MULTILINE | re.IGNORECASE)


@pytest.mark.parametrize("target", ["operator", "router", "worker"])
def test_dockerfile_target(target: str) -> None:
    _, stages = dockerfile()
    assert target in stages
    user = final_user(stages, target)
    # Numeric, so the kubelet can verify runAsNonRoot (it cannot resolve a user name).
    assert user is not None and re.fullmatch(r"10001(:10001)?", user), user
    entry = [json.loads(e) for e in stages[target].all("ENTRYPOINT")]
    assert entry and entry[-1] == ["dpserve"]


@pytest.mark.parametrize("target", ["operator", "router"])
def test_light_images_carry_no_torch(target: str) -> None:
    _, stages = dockerfile()
    runs = " ".join(run for stage in closure(stages, target) for run in stage.all("RUN"))
    # Only the extra's own requirement list (images/requirements.py writes one per extra).
    assert f"/requirements/{target}.txt" in runs
    assert "worker" not in runs
    assert "torch" not in runs.lower() and "make-tiny-model" not in runs


def test_worker_image_is_cpu_by_default_and_cuda_by_build_arg() -> None:
    global_args, stages = dockerfile()
    assert global_args["PYTHON_IMAGE"].startswith("python:3.11-slim")
    # FROM ${BASE}: CPU builds use the same slim Python as the other images.
    assert global_args["BASE"] == global_args["PYTHON_IMAGE"]
    worker = closure(stages, "worker")
    assert any(stage.base in ("${BASE}", "$BASE") for stage in worker)
    args = {a.split("=", 1)[0]: a.partition("=")[2] for st in worker for a in st.all("ARG")}
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    runs = " ".join(run for stage in worker for run in stage.all("RUN"))
    # An empty TORCH_INDEX_URL leaves out --index-url: pip's configured index.
    assert '${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}' in runs
    assert "/requirements/worker.txt" in runs
    own = " ".join(stages["worker"].all("RUN"))
    assert "dpserve make-tiny-model /models/tiny" in own
    assert "dpserve make-tiny-lora --model /models/tiny /models/loras/tiny" in own


@pytest.mark.parametrize("target", ["operator", "router", "worker"])
def test_third_party_layers_do_not_depend_on_the_code(target: str) -> None:
    """A change in dpserve/ rebuilds only the layer that installs the wheel (--no-deps),
    never the ones below it with the third-party packages (the worker's: torch)."""
    _, stages = dockerfile()
    final = stages[target]
    assert "wheel" in sources(final)
    assert all("--no-deps" in run for run in final.all("RUN") if "/wheels" in run)
    below = closure(stages, final.base)
    assert "wheel" not in {stage.name for stage in below}
    assert not any(stage.all("COPY") for stage in below)  # the code only ever comes by COPY
    installs = [run for stage in below for run in stage.all("RUN") if " install " in run]
    assert installs, "the third-party packages are installed below the final stage"


def test_pip_gets_the_machine_config_only_as_build_secrets() -> None:
    _, stages = dockerfile()
    runs = [run for stage in stages.values() for run in stage.all("RUN")]
    pip_runs = [run for run in runs if re.search(r"\bpip\b", run)]
    assert pip_runs
    for run in pip_runs:
        # Each pip is a virtual environment's (Debian's system Python is externally managed).
        commands = re.findall(r"(\S*pip3?)\s+(?:install|wheel|download)\b", run)
        assert commands and all(re.fullmatch(r"/opt/\w+/bin/pip", c) for c in commands), run
        assert "/run/pip-run.sh" in run, run
        # Everything but the local wheel's install reaches an index, so it gets both secrets.
        if "--no-deps --no-cache-dir /run/wheels/" not in run:
            ids = {m.get("id") for m in mounts(run) if m["type"] == "secret"}
            assert ids == {"pip-conf", "pip-cert"}, run
    copied = " ".join(c for stage in stages.values() for c in stage.all("COPY"))
    assert "pip" not in copied and "secret" not in copied


def test_dockerfile_is_multi_stage_on_slim_python() -> None:
    _, stages = dockerfile()
    assert len(stages) >= 5
    for target in ("operator", "router"):
        bases = {stage.base for stage in closure(stages, target)} - set(stages)
        assert bases == {"${PYTHON_IMAGE}"}, bases


def test_dockerignore_keeps_the_context_to_what_the_dockerfile_reads() -> None:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    patterns = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    # Everything out, then exactly the paths the Dockerfile reads let back in.
    assert patterns[0] == "*"
    assert {p[1:] for p in patterns if p.startswith("!")} == context_paths()
    assert {"**/__pycache__", "**/*.py[cod]"} <= set(patterns)
    assert {"pyproject.toml", "README.md", "dpserve"} <= context_paths()
